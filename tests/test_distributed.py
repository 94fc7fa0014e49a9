"""treadle.distributed: one-process identities, then real 2-process jobs on CPU (gloo) under torchrun.

The multi-process tests launch ``tests/_dist_worker.py`` with ``python -m torch.distributed.run
--nproc_per_node 2`` and compare with a one-process run made here, in the test process, from the same
builders: 2 processes x batch b must give the per-step losses and final weights of 1 process x batch 2b
(to float32 rounding), under DDP and under FSDP2, for the base Trainer and for SFT, DPO and GRPO (each rank
sampling whole groups of its own prompts). The data has rows of very different label-token counts, so a per-rank
normalisation would not match. The same worker also runs on two torchrun "nodes" of one process each
(``--nnodes 2 --rdzv-backend c10d``, launched twice), which must train as the 2-process job does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import _dist_worker as worker
import pytest
import torch

from treadle import distributed as dist
from treadle.logprobs import prefix

WORKER = Path(__file__).with_name("_dist_worker.py")
ROOT = Path(__file__).resolve().parents[1]
LOSS_RTOL = 1e-5  # float32 sums in a different order: ~1e-7 relative observed
WEIGHT_ATOL = 2e-5  # after 4 AdamW steps of lr 3e-3: ~1e-6 observed


# ---------------------------------------------------------------------------------------------------------
# One process: every helper is the identity, nothing is wrapped
# ---------------------------------------------------------------------------------------------------------
def test_helpers_are_identities_in_one_process():
    t = torch.tensor([1.0, 2.0])
    assert not dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
    assert dist.all_reduce_sum(t) is t and dist.gather_objects(3) == [3]
    assert dist.gather_padded([t[None], t[None]]).tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert dist.any_rank(True, torch.device("cpu")) and not dist.any_rank(False, torch.device("cpu"))
    dist.init_distributed(torch.device("cpu"))  # no torchrun environment: stays a single process
    assert not dist.is_initialized()


def test_models_are_not_wrapped_without_a_process_group():
    from treadle import TrainingArguments

    model = torch.nn.Linear(2, 2)
    assert dist.wrap_model(model, TrainingArguments(fsdp="full_shard")) is model
    assert not dist.is_fsdp(model) and dist.full_state_dict(model) is None
    with dist.no_sync(model, skip_sync=True):
        pass


def test_transformer_blocks_are_the_decoder_layers():
    model = worker.tiny_llama()
    assert dist.transformer_blocks(model) == list(model.model.layers)


def test_transformer_blocks_of_a_plain_module_are_its_module_list_entries_outermost_first():
    inner = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    outer = torch.nn.ModuleList([torch.nn.Sequential(inner[0]), torch.nn.Linear(2, 2)])
    model = torch.nn.Module()
    model.blocks, model.extra = outer, inner
    # inner[0] sits inside outer[0]: shard the outer block only, or FSDP2 would nest the same parameters
    assert dist.transformer_blocks(model) == [outer[0], outer[1]]


def test_collective_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(dist.TIMEOUT_ENV, raising=False)
    assert dist.collective_timeout_s() == 1800
    monkeypatch.setenv(dist.TIMEOUT_ENV, "7.5")
    assert dist.collective_timeout_s() == 7.5
    for bad in ("soon", "0"):
        monkeypatch.setenv(dist.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=dist.TIMEOUT_ENV):
            dist.collective_timeout_s()


def test_rank_errors_leaves_one_process_errors_alone():
    @dist.rank_errors
    def fail():
        raise KeyError("x")

    with pytest.raises(KeyError) as info:
        fail()
    assert not getattr(info.value, "__notes__", None)
    assert fail.__name__ == "fail"


# ---------------------------------------------------------------------------------------------------------
# Launching 2-process jobs
# ---------------------------------------------------------------------------------------------------------
def launch(scenarios: str, out: Path, *, timeout: float = 420, extra_env: dict | None = None):
    """Run the worker under torchrun with 2 CPU processes; returns (exit code, output, seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        scenarios,
        str(out),
    ]
    start = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


TRAINER_SCENARIOS = {
    "sft": "sft",
    "sft_compiled": "sft",
    "dpo": "dpo",
    "dpo_precomputed": "dpo",
    "grpo": "grpo",
    "grpo_fsdp": "grpo",
    "dpo_padded": "dpo",
    "grpo_padded": "grpo",
    "grpo_unshared": "grpo",
    "grpo_sgd": "grpo",
    "grpo_padded_sgd": "grpo",
    "grpo_groups": "grpo",
    "distill": "distillation",
}
GOOD_SCENARIOS = ["collectives", "trainer", "fsdp"] + [
    name for name, module in TRAINER_SCENARIOS.items() if available(f"treadle.trainers.{module}")
]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One launch runs every scenario that should succeed; each test reads its scenario's results."""
    out = tmp_path_factory.mktemp("dist")
    code, output, _ = launch(",".join(GOOD_SCENARIOS), out)
    assert code == 0, f"the 2-process job failed (exit {code}):\n{output[-6000:]}"
    return out


def result(out: Path, scenario: str) -> dict:
    with open(out / f"{scenario}.json") as f:
        return json.load(f)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(got: dict, want: dict, atol: float = WEIGHT_ATOL) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The base Trainer in this one process with batch 2b: per-step losses, eval loss, final weights."""
    out = tmp_path_factory.mktemp("reference")
    trainer, summary = worker.run_trainer(str(out), world_size=1)
    summary["train_loss"] = trainer.state.total_loss_sum / trainer.state.total_loss_items
    summary["weights"] = load_weights(out / "final")
    return summary


# ---------------------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_collectives_across_two_ranks(job):
    for rank in (0, 1):
        with open(job / f"collectives_rank{rank}.json") as f:
            got = json.load(f)
        assert got["gather_padded"] == [[0.0, -100.0], [1.0, 1.0]]  # rank 0's shorter row padded with -100
        assert got["metric_means"] == {"a": 2.0, "b": 7.5}  # (1 + 3) / 2 and (10 + 20) / 4, matched by name
        assert got["one_rank_recorded_nothing"] == {"only_rank_0": 3.0}  # no hang: rank 1 adds zeros
        assert got["all_reduce_sum"] == 3.0
        assert got["any_rank_one"] is True and got["any_rank_none"] is False
        assert got["gather_objects"] == ["r0", "r1"]


# ---------------------------------------------------------------------------------------------------------
# Base Trainer: DDP and FSDP2 give the one-process numbers; resume continues exactly
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario, wrapper", [("trainer", "DistributedDataParallel"), ("fsdp", "FSDPLlamaForCausalLM")]
)
def test_two_processes_match_one_process_with_twice_the_batch(job, reference, scenario, wrapper):
    got = result(job, scenario)
    assert got["world_size"] == 2 and got["wrapper"] == wrapper
    assert len(got["losses"]) == worker.STEPS
    assert got["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    assert got["train_loss"] == pytest.approx(reference["train_loss"], rel=LOSS_RTOL)
    assert got["eval_loss"] == pytest.approx(reference["eval_loss"], rel=LOSS_RTOL)
    assert_same_weights(load_weights(job / scenario / "full" / "final"), reference["weights"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["trainer", "fsdp"])
def test_resume_under_two_processes_continues_exactly(job, scenario):
    got = result(job, scenario)
    # the resumed run restores the log history of steps 1-2 and trains steps 3-4 again
    assert got["resumed_losses"] == got["losses"]
    full, resumed = job / scenario / "full" / "final", job / scenario / "resumed" / "final"
    assert_same_weights(load_weights(resumed), load_weights(full), atol=0)


@pytest.mark.slow
def test_fsdp_checkpoints_are_sharded_and_the_export_is_consolidated(job):
    from transformers import LlamaForCausalLM

    checkpoint = job / "fsdp" / "full" / "checkpoint-2"
    for folder in (dist.MODEL_SHARDS, dist.OPTIMIZER_SHARDS):
        assert (checkpoint / folder / ".metadata").is_file()
        assert sorted(p.name for p in (checkpoint / folder).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()
    # the export is one ordinary save_pretrained folder, tied lm_head left out as for an unsharded model
    export = job / "fsdp" / "full" / "final"
    model = LlamaForCausalLM.from_pretrained(str(export))
    weights = load_weights(export)
    assert "lm_head.weight" not in weights and model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(t.numel() for t in weights.values()) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_only_rank_zero_writes_the_run_record(job):
    run = job / "trainer" / "full"
    with open(run / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # once each, not once per rank
    assert sum("eval_loss" in r for r in records) == 1 and sum("train_runtime" in r for r in records) == 1
    checkpoint = run / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["global_step"] == 2


# ---------------------------------------------------------------------------------------------------------
# Failures: the rank is named, nobody waits forever
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_exception_on_one_rank_ends_the_job_naming_the_rank(tmp_path):
    code, output, _ = launch("error", tmp_path, timeout=300)
    assert code != 0
    assert "injected failure in compute_loss" in output
    assert "treadle: raised on rank 1 of 2" in output
    # rank 0 was ended by rank 1's failure, not by waiting out a collective's timeout (1800 s by default)
    assert "timed out" not in output.lower()


@pytest.mark.slow
def test_a_rank_stuck_outside_collectives_makes_the_others_time_out(tmp_path):
    # rank 1 fails but sleeps 600 s instead of exiting; rank 0 must give up after TREADLE_DDP_TIMEOUT
    code, output, _ = launch("stuck", tmp_path, timeout=400, extra_env={dist.TIMEOUT_ENV: "5"})
    assert code != 0
    assert "treadle: raised on rank 0 of 2" in output
    assert "Timed out" in output or "timed out" in output
    # the job ended while rank 1 was still stuck: it never woke to write its marker
    assert not (tmp_path / "stuck_rank_1_woke").exists()


# ---------------------------------------------------------------------------------------------------------
# SFT, DPO, GRPO under 2 processes
# ---------------------------------------------------------------------------------------------------------
def trainer_reference(tmp_path, name: str):
    """Train the SFT / DPO reference in this process with batch 2b (DPO scoring the reference model as it
    goes, never precomputed); (losses, rewards/margins, num_tokens, final weights)."""
    if name == "sft":
        from treadle import SFTTrainer as cls

        parts = worker.sft_parts(str(tmp_path), 1)
    else:
        from treadle import DPOTrainer as cls

        parts = worker.dpo_parts(str(tmp_path), 1)
    trainer = cls(**parts)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    history = trainer.state.log_history
    margins, tokens = ([e[k] for e in history if k in e] for k in ("rewards/margins", "num_tokens"))
    return worker.step_losses(history), margins, tokens, load_weights(tmp_path / "final")


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["sft", "sft_compiled", "dpo", "dpo_precomputed"])
def test_sft_and_dpo_two_processes_match_one_process(job, tmp_path, scenario):
    name = TRAINER_SCENARIOS[scenario]
    if not available(f"treadle.trainers.{name}"):
        pytest.skip(f"treadle.trainers.{name} does not exist yet")
    losses, margins, tokens, weights = trainer_reference(tmp_path, name)
    got = result(job, scenario)
    assert got["world_size"] == 2 and len(got["losses"]) == 2
    assert got["losses"] == pytest.approx(losses, rel=LOSS_RTOL)
    if name == "dpo":  # a trainer's own metric, averaged over both ranks' pairs before rank 0 logs it
        assert len(margins) == 2 and margins[1] != 0
        assert got["margins"] == pytest.approx(margins, rel=1e-4, abs=1e-6)
        assert got["num_tokens"] == tokens and len(tokens) == 2  # TRL's num_tokens: both ranks' tokens
    assert_same_weights(load_weights(job / scenario / "final"), weights)


@pytest.mark.slow
def test_grpo_runs_with_groups_spanning_ranks(job):
    if not available("treadle.trainers.grpo"):
        pytest.skip("treadle.trainers.grpo does not exist yet")
    got = result(job, "grpo")
    assert got["final_step"] == 2 and len(got["losses"]) == 2
    assert all(abs(x) < 1e3 for x in got["losses"] + got["rewards"])
    with open(job / "grpo" / "completions.jsonl") as f:
        records = [json.loads(line) for line in f]
    groups = defaultdict(list)
    for r in records:
        groups[(r["step"], r["prompt"])].append(r)
    # one prompt per generation, its 8 completions sampled 4 on each rank: the same prompt on both ranks
    assert len(groups) == 2 and all(len(g) == 8 for g in groups.values())
    for group in groups.values():
        rewards = [r["rewards"]["digit_count_reward"] for r in group]
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        # the advantage uses the statistics of the whole group, gathered from both ranks
        want = [(x - mean) / (std + 1e-4) for x in rewards]
        assert [r["advantage"] for r in group] == pytest.approx(want, abs=1e-5)
    # the length metrics and num_tokens cover both ranks' completions (each rank's, as its reward function saw them)
    total = 0
    for log, ranks in zip(got["logs"], got["sampled"], strict=True):
        lengths = [n for rank in ranks for n in rank["lengths"]]
        ended = [n for rank in ranks for n, eos in zip(rank["lengths"], rank["ended"]) if eos] or [0]
        total += sum(rank["prompt_tokens"] for rank in ranks) + sum(lengths)
        assert len(lengths) == 8 and log["num_tokens"] == total
        want = {"min_length": min(lengths), "max_length": max(lengths), "mean_length": statistics.fmean(lengths)}
        want |= {"min_terminated_length": min(ended), "max_terminated_length": max(ended)}
        want["mean_terminated_length"] = statistics.fmean(ended)
        assert {k: log[f"completions/{k}"] for k in want} == pytest.approx(want)


@pytest.mark.slow
def test_grpo_under_fsdp2_samples_and_learns_as_under_ddp(job):
    if not available("treadle.trainers.grpo"):
        pytest.skip("treadle.trainers.grpo does not exist yet")
    ddp, fsdp = result(job, "grpo"), result(job, "grpo_fsdp")
    assert fsdp["wrapper"] == "FSDPLlamaForCausalLM" and fsdp["final_step"] == 2
    # sampling is seeded per rank and generation, so the same completions come out of the gathered shards
    assert fsdp["rewards"] == ddp["rewards"]
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=LOSS_RTOL, abs=1e-7)
    assert_same_weights(load_weights(job / "grpo_fsdp" / "final"), load_weights(job / "grpo" / "final"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_padding_free_under_two_processes_equals_padded(job, name):
    """The 2-process runs with padding-free forwards (the default; GRPO's without sharing prompts) and with padded
    ones: same losses, same weights (GRPO: the same samples too, so the same rewards)."""
    if not available(f"treadle.trainers.{name}"):
        pytest.skip(f"treadle.trainers.{name} does not exist yet")
    packed, padded = result(job, name if name == "dpo" else "grpo_unshared"), result(job, f"{name}_padded")
    assert packed["losses"] == pytest.approx(padded["losses"], rel=1e-5, abs=1e-7)
    assert packed.get("rewards") == padded.get("rewards")
    folder = name if name == "dpo" else "grpo_unshared"
    assert_same_weights(load_weights(job / folder / "final"), load_weights(job / f"{name}_padded" / "final"))


@pytest.mark.slow
def test_shared_prefix_under_two_processes_equals_padded(job):
    """GRPO with each rank's 4 completions after their prompt once (``shared_prefix``, the default; every group
    spans both ranks) and padded: the same losses and rewards; with SGD (weights linear in the gradients) the same
    weights. Under AdamW the losses agree too (``grpo`` vs ``grpo_padded``); the weights differ by up to ~2.4e-5
    where a near-zero gradient's float32 noise is divided by its own size."""
    if not available("treadle.trainers.grpo"):
        pytest.skip("treadle.trainers.grpo does not exist yet")
    assert result(job, "grpo")["losses"] == pytest.approx(result(job, "grpo_padded")["losses"], rel=1e-5, abs=1e-7)
    shared, padded = result(job, "grpo_sgd"), result(job, "grpo_padded_sgd")
    assert shared["losses"] == pytest.approx(padded["losses"], rel=1e-5, abs=1e-7)
    assert shared["rewards"] == padded["rewards"]
    assert_same_weights(
        load_weights(job / "grpo_sgd" / "final"), load_weights(job / "grpo_padded_sgd" / "final"), atol=1e-6
    )


@pytest.fixture(scope="module")
def grpo_groups_reference(tmp_path_factory):
    """The whole-group GRPO run in this one process with both prompts of each generation: losses, rewards,
    the prompts sampled, final weights."""
    out = tmp_path_factory.mktemp("grpo_groups_reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun worker (OMP_NUM_THREADS=1): 2 threads sum in another order, and on
    try:  # AVX2 kernels one weight then differs by 1.1e-5 after the 3 steps (the tolerance is 1e-5)
        with pytest.MonkeyPatch.context() as patch:  # the ranks' way (DDP: the 4D mask), not the cache's: the
            patch.setattr(prefix, "takes_cache", lambda model: False)  # same sums in the same order
            _, summary = worker.grpo_groups_run(str(out), 1)
    finally:
        torch.set_num_threads(threads)
    summary["weights"] = load_weights(out / "final")
    return summary


def assert_grpo_groups_match(got: dict, weights: dict, reference: dict) -> None:
    """2 processes (each prompt's group whole on one rank, rewards gathered) = 1 process with the doubled batch."""
    assert got["world_size"] == 2 and len(got["losses"]) == 3
    rank0, rank1 = got["sampled_by_rank"]
    for generation, (mine, theirs, both) in enumerate(zip(rank0, rank1, reference["sampled"])):
        # one prompt a rank, its 4 completions sampled there (a whole group), the two prompts of the 1-process batch
        assert len(mine) == len(theirs) == 1 and mine[0][1] == theirs[0][1] == 4, generation
        assert mine + theirs == both and mine[0][0] != theirs[0][0]
    assert got["rewards"] == pytest.approx(reference["rewards"], abs=1e-6)  # means over both ranks' groups
    # a GRPO loss of zero-mean advantages is ~1e-7 here: its float noise, not a difference of the runs, differs with
    # the packing (each rank shares its one prompt; one process shares two), so the absolute tolerance is 5e-7
    assert got["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL, abs=5e-7)
    assert_same_weights(weights, reference["weights"], atol=1e-5)


@pytest.mark.slow
def test_grpo_with_whole_groups_per_rank_matches_one_process(job, grpo_groups_reference):
    assert_grpo_groups_match(
        result(job, "grpo_groups"), load_weights(job / "grpo_groups" / "final"), grpo_groups_reference
    )


@pytest.mark.slow
def test_distillation_two_processes_match_one_process(job, tmp_path):
    """On-policy distillation, 8 prompts a step in 2 accumulation steps: 2 processes x micro-batch 2 give the losses
    and weights of 1 process x micro-batch 4. The ranks' completion-token counts differ, so the loss is exact only
    when it is divided by the window's tokens of both ranks (a per-rank count would weigh their tokens unequally)."""
    _, want = worker.distill_run(str(tmp_path), 1)
    got = result(job, "distill")
    assert got["world_size"] == 2 and len(got["losses"]) == 2
    rank0, rank1 = got["sampled_by_rank"]
    assert [a + b for a, b in zip(rank0, rank1)] == want["sampled"]  # each rank half of every generation's prompts
    tokens0, tokens1 = got["tokens_by_rank"]  # per micro-batch, counted once for the window's normaliser
    assert len(tokens0) == len(tokens1) == 4 and sum(tokens0) + sum(tokens1) == sum(want["tokens"])
    assert any(sum(tokens0[i : i + 2]) != sum(tokens1[i : i + 2]) for i in (0, 2))
    assert got["losses"] == pytest.approx(want["losses"], rel=LOSS_RTOL)
    # SGD: weights linear in the gradients, so only float32 sums in another order differ (~4e-9 observed); the
    # tolerance of the GRPO SGD comparison. A per-rank normaliser moves them by ~6e-5 here.
    weights = load_weights(tmp_path / "final")
    assert_same_weights(load_weights(job / "distill" / "final"), weights, atol=1e-6)
    start = worker.toy_model_and_tokenizer()[0].state_dict()
    assert max(float((weights[name] - start[name]).abs().max()) for name in weights) > 1e-4  # it trained (~9e-4)


# ---------------------------------------------------------------------------------------------------------
# Two torchrun "nodes" on this machine (rendezvous c10d): the 2-process numbers again
# ---------------------------------------------------------------------------------------------------------
TWO_NODE_SCENARIOS = ("trainer", "fsdp", "grpo_groups")


def launch_two_nodes(scenarios: str, out: Path, *, timeout: float = 420):
    """Start the worker on two torchrun "nodes" of one process each, as two machines would (same command, one
    rendezvous endpoint); returns [(exit code, output)] per node, the code None for a node stopped because the
    other failed.

    The rendezvous store is this process's (``is_host=0`` for both agents), as a cluster's endpoint is a host that
    outlives the nodes. Left to the agents, the first to bind a port picked here (bound, released, then bound again
    seconds later, a window in which another process may take it) hosts the store, and its exit ends the store under
    the other agent. The agents log at INFO (rendezvous rounds, restarts, exit barrier) into the node logs."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # its port held
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "LOGLEVEL": "INFO"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{store.port}",
        "--rdzv-conf",
        "is_host=0",
        "--rdzv-id",
        f"two-nodes-{store.port}",
        str(WORKER),
        scenarios,
        str(out),
    ]
    logs = [out / f"node{i}.log" for i in range(2)]
    nodes = []
    try:
        for log in logs:
            with open(log, "w") as f:
                nodes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        # a node that failed leaves the other waiting out torchrun's exit barrier (300 s): stop it then (code None)
        while any(node.poll() is None for node in nodes) and not any(node.poll() for node in nodes):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(command, timeout)
            time.sleep(0.5)
        return [(node.poll(), log.read_text()) for node, log in zip(nodes, logs)]
    finally:
        for node in nodes:
            node.kill()
            node.wait()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    # One relaunch, into a fresh folder, when a node fails. 1 launch in ~45 here (load average 6-18) had rank 0's
    # worker write its last result, then abort on its way out ("terminate called without an active exception",
    # exit -6; its agent exits 1 and the other waits out the 300 s exit barrier): the worker now frees its
    # trainers and destroys the process group before it exits (_dist_worker.main), and prints its threads' stacks
    # if it still aborts. The relaunch's results are checked exactly as the first's would be; the first failure is
    # a warning, so that the summary of a passing run shows it, with the folder that keeps both nodes' logs.
    for attempt in range(2):
        out = tmp_path_factory.mktemp("two_nodes")
        failed = [(code, output) for code, output in launch_two_nodes(",".join(TWO_NODE_SCENARIOS), out) if code]
        if not failed:
            return out
        warnings.warn(
            f"two-node job, attempt {attempt + 1}: a node exited {failed[0][0]} (both logs in {out}):\n"
            f"{failed[0][1][-4000:]}",
            stacklevel=1,
        )
    raise AssertionError(f"a node of the two-node job failed twice (exit {failed[0][0]}):\n{failed[0][1][-6000:]}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario, wrapper", [("trainer", "DistributedDataParallel"), ("fsdp", "FSDPLlamaForCausalLM")]
)
def test_two_nodes_match_one_process_with_twice_the_batch(two_nodes, reference, scenario, wrapper):
    got = result(two_nodes, scenario)
    assert got["world_size"] == 2 and got["wrapper"] == wrapper
    assert got["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    assert got["eval_loss"] == pytest.approx(reference["eval_loss"], rel=LOSS_RTOL)
    assert_same_weights(load_weights(two_nodes / scenario / "full" / "final"), reference["weights"])
    assert got["resumed_losses"] == got["losses"]  # a checkpoint of two nodes resumes exactly too


@pytest.mark.slow
def test_grpo_across_two_nodes_matches_one_process(two_nodes, grpo_groups_reference):
    assert_grpo_groups_match(
        result(two_nodes, "grpo_groups"), load_weights(two_nodes / "grpo_groups" / "final"), grpo_groups_reference
    )


# ---------------------------------------------------------------------------------------------------------
# The GPU check script stays runnable
# ---------------------------------------------------------------------------------------------------------
# The GPU image has no ``datasets``: the smoke runs with it made unimportable, as it would be there.
NO_DATASETS = """import sys
class NoDatasets:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "datasets":
            raise ImportError("datasets is not on the GPU image")
sys.meta_path.insert(0, NoDatasets())
"""


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_mode_without_datasets(tmp_path):
    out = tmp_path / "gpu_check.json"
    (tmp_path / "sitecustomize.py").write_text(NO_DATASETS)
    path = os.pathsep.join([str(tmp_path), str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}  # ROOT: the benchmarks package
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--cpu-smoke", "--steps", "2", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    by_mode = {r["mode"]: r for r in report["results"] if r["mode"] in ("ddp", "fsdp")}
    assert by_mode["ddp"]["wrapper"] == "DistributedDataParallel"
    assert by_mode["fsdp"]["wrapper"] == "FSDPLlamaForCausalLM"
    for r in by_mode.values():
        assert r["tokens_per_step"] == 2 * 32 and r["tokens_per_s"] > 0 and r["peak_process_rss_gib"] > 0
    assert by_mode["ddp"]["first_loss"] == pytest.approx(by_mode["fsdp"]["first_loss"], abs=1e-6)
    real = {r["row"]: r for r in report["results"] if r["mode"] == "real"}
    assert list(real) == ["own", "hf", "vllm-colocate", "vllm-server", "grpo"]
    for name in ("own", "hf", "grpo"):
        assert real[name]["status"] == "ok" and real[name]["tokens_per_s"] > 0 and real[name]["dtype"] == "float32"
    assert real["grpo"]["sample_and_score_s"] > 0 and len(real["grpo"]["losses"]) == 2
    vllm = importlib.util.find_spec("vllm") is not None
    assert {real[name]["status"] for name in ("vllm-colocate", "vllm-server")} == {"ok" if vllm else "skipped"}
