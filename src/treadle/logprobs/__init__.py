"""Per-token log-probabilities without the ``[B, T, V]`` logits, in three rooms (import from the submodules inside
treadle; this file only re-exports the public names for users, tests and benchmarks):

- ``logprobs.logsoftmax``: the two memory-bounded log-softmax kernels (selective from logits; chunked from hidden
  states and the LM head);
- ``logprobs.tokens``: per-token log-probs of a causal LM's forward (the fast-path seam that takes the final hidden
  states instead of the logits, padding-free packing);
- ``logprobs.prefix``: shared-prefix forwards (each group's prompt once, its completions after it under a 4D mask).
"""

from treadle.logprobs.logsoftmax import chunk_rows, chunked_token_logps, selective_log_softmax
from treadle.logprobs.prefix import prompt_first_layout, shared_prefix_logps
from treadle.logprobs.tokens import TokenLogps, hidden_states_and_head, token_logps

__all__ = [
    "TokenLogps",
    "chunk_rows",
    "chunked_token_logps",
    "hidden_states_and_head",
    "prompt_first_layout",
    "selective_log_softmax",
    "shared_prefix_logps",
    "token_logps",
]
