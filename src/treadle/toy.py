"""``treadle.toy``, the public name of the embedded default: the tiny model, the character tokenizer and the synthetic
tasks live in ``treadle.demos.toy``; importing this module gives that very module (so a patch of one is a patch of
the other)."""

import sys

from treadle.demos import toy

sys.modules[__name__] = toy
