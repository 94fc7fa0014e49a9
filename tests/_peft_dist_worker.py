"""LoRA under torchrun for tests/test_peft.py: DPO with a LoRA policy (its own reference, adapters disabled) on
2 CPU processes (gloo), under DDP and then FSDP2::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_peft_dist_worker.py OUT_DIR

Rank 0 writes ``OUT_DIR/<ddp|fsdp>.json`` and the adapter (``save_model``) to ``OUT_DIR/<ddp|fsdp>/final``.
The test runs ``run(..., world_size=1)`` in its own process as the one-process reference (batch 2b).
"""

from __future__ import annotations

import json
import os
import sys

import _dist_worker as base
import torch


def run(out: str, world_size: int, fsdp: str = "") -> dict:
    from peft import LoraConfig

    from treadle import DPOTrainer

    parts = base.dpo_parts(out, world_size, fsdp=fsdp)
    before = {k: v.clone() for k, v in parts["model"].state_dict().items()}
    trainer = DPOTrainer(
        **parts, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    optimized = sorted(names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"])
    with torch.no_grad():  # base weights of this rank (its shards under FSDP2) against the model as built
        full = {
            k.replace("base_model.model.", "").replace(".base_layer", ""): getattr(v, "full_tensor", lambda v=v: v)()
            for k, v in trainer.model.state_dict().items()
            if "lora_" not in k
        }
    unchanged = all(torch.equal(full[k], v) for k, v in before.items() if k in full) and len(full) >= len(before)
    return {
        "losses": base.step_losses(trainer.state.log_history),
        "optimizer_params": optimized,
        "base_unchanged": unchanged,
        "ref_model": trainer.ref_model is None,
    }


def main(out: str) -> None:
    torch.set_num_threads(1)
    from treadle import distributed as dist

    dist.init_distributed(torch.device("cpu"))
    for name, fsdp in (("ddp", ""), ("fsdp", "full_shard")):
        result = run(os.path.join(out, name), dist.get_world_size(), fsdp=fsdp)
        if dist.is_main_process():
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(result, f)
    dist.finish()  # frees the trainers' reference cycles that hold the group first (pytorch/pytorch#190489)


if __name__ == "__main__":
    main(sys.argv[1])
