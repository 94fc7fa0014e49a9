"""A reward function that examples/grpo.yaml loads by path (``reward_funcs: [rewards.py:is_a_number]``; a
relative path is looked up from the working folder, then from the config's folder).

Every reward function follows the contract of ``treadle.rewards``:
``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, one value per completion.
"""


def is_a_number(prompts, completions, **columns):
    """0.2 for a completion made of digits only (a well-formed answer, right or wrong), else 0.0."""
    return [0.2 if completion.strip().isdigit() else 0.0 for completion in completions]
