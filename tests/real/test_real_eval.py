"""``treadle eval`` on SmolLM2-135M-Instruct: its greedy strict and lenient scores equal a plain transformers
``generate`` loop over the same reasoning-gym items, scored by reasoning-gym's own ``extract_answer`` and
``score_answer`` (a few items, 32 new tokens)."""

import json
import re

import torch
from reasoning_gym import create_dataset
from reasoning_gym.utils import extract_answer

from treadle import tasks
from treadle.cli import command as cli

CONFIGS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3},
}
N, SEED, TOKENS = 4, 10_000, 32


def plain_scores(model, tokenizer, name: str) -> dict[str, float]:
    dataset = create_dataset(name, size=N, seed=SEED, **CONFIGS[name])
    strict = lenient = 0.0
    for i in range(N):
        item = dataset[i]
        chat = [{"role": "system", "content": tasks.ANSWER_PROMPT}, {"role": "user", "content": item["question"]}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False)
        text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        answer = extract_answer(text)
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
        fallback = answer if answer is not None else (numbers[-1] if numbers else None)
        strict += dataset.score_answer(answer, item) if answer is not None else 0.0
        lenient += dataset.score_answer(fallback, item) if fallback is not None else 0.0
    return {"strict": strict / N, "lenient": lenient / N}


def test_eval_equals_a_plain_generate_loop(tmp_path, smollm2, smollm2_folder):
    model, tokenizer = smollm2
    spec = json.dumps(CONFIGS)
    argv = ["eval", smollm2_folder, "--tasks", spec, "--n", N, "--seed", SEED, "--max-new-tokens", TOKENS]
    assert cli.main([str(a) for a in [*argv, "--output-dir", tmp_path]]) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    for name in CONFIGS:
        got = report["per_task"][name]
        assert {"strict": got["strict"], "lenient": got["lenient"]} == plain_scores(model.eval(), tokenizer, name)
