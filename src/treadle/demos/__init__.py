"""The embedded default and every ``treadle demo``: nothing to download, real learning on a laptop CPU.

- ``demos.toy``: a tiny Llama, a character tokenizer and synthetic tasks with exact verifiers (public as
  ``treadle.toy``);
- ``demos.toy_vision``: tiny Qwen2-VL, LLaVA and Idefics3 models with processors built in code, the counting task;
- ``demos.addition``: ``treadle demo``: SFT then GRPO on 2-digit addition, scored on held-out problems (and the
  pieces the other demos share: the run folder, the SFT warm start, the results table);
- ``demos.tools``: ``--task tools``, GRPO with a calculator tool;
- ``demos.distill``: ``--task distill``, on-policy distillation vs GRPO vs SFT on a teacher's answers;
- ``demos.count``: ``--task count``, a tiny VLM counts shapes on canvases.
"""
