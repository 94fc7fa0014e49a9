"""What GRPO and on-policy distillation share, in rooms: ``data`` (the typed rollouts, samples, tickets and the
generation buffer), ``vision`` (prompts with images), ``asynchronous`` and ``worker`` (``max_staleness``). Import
from the rooms."""
