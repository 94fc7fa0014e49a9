"""vLLM's server mode (treadle.engines.vllm_client, treadle.engines.vllm_server, the ``treadle vllm-serve`` command
treadle.cli.vllm_serve): the client and a real server on CPU.

The tests marked ``vllm`` need .venv-vllm (`make test-vllm`): one ``treadle vllm-serve`` subprocess per module,
serving toy "small" saved to a temporary folder (head size 32: vLLM's CPU attention has no kernel for toy tiny's
16). Each checks the server against an independent reference: the own sampler's greedy tokens, the trained model's
log-probs after a GRPO step (the server's copy before the sync must differ from them, so a skipped sync fails),
the policy's shapes (a server of another model is refused), and a checkpoint left complete when the server is
killed mid-run (the last test: it kills the module's server). The unmarked tests need no vLLM: the client's
refusals against a URL where nothing listens and a stand-in server that answers another identity, the settings'
refusals, and ``treadle vllm-serve``'s port. The client against servers that hang, answer garbage, are foreign or
serve another run: test_vllm_client.py.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from _factories import digit_sum_reward
from _vllm_common import load_with_push_skipped, model_logps, prompts, rows_of

import treadle.cli.vllm_serve as vllm_serve
from treadle import checkpoint
from treadle.cli import command as cli
from treadle.demos import toy
from treadle.engines.vllm import merged_state_dict
from treadle.engines.vllm_client import (
    PROTOCOL,
    SERVER_NAME,
    VLLMServerEngine,
    VLLMServerError,
    identity_mismatch,
    server_url,
)
from treadle.errors import is_user_error
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import sample_completions
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

EOS = 2  # the toy tokenizer's eos id
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tmp_path, url, **overrides):
    values = dict(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1000,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=600.0,
        temperature=1.0,
    )
    values.update(overrides)
    return GRPOConfig(**values)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, process) of one `treadle vllm-serve` of toy small (seed 0), started once for the module."""
    folder = tmp_path_factory.mktemp("served") / "small"
    toy.build_model("small", tokenizer=toy.build_tokenizer(), seed=0).save_pretrained(folder)
    port, log = free_port(), open(folder.parent / "server.log", "w")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "treadle", "vllm-serve", str(folder), "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def policy():
    tok = toy.build_tokenizer()
    return toy.build_model("small", tokenizer=tok, seed=3), tok  # another seed than the server's: the sync must work


# ---------------------------------------------------------------------------------------- the real server
@pytest.mark.vllm
def test_greedy_completions_over_the_server_equal_the_own_samplers(server, policy):
    model, tok = policy
    engine = VLLMServerEngine(model, server[0], timeout=600)
    try:
        check_greedy_and_seeded(engine, model, tok)
    finally:
        engine.close()  # the server serves one run at a time: the next test's claims it


def check_greedy_and_seeded(engine, model, tok):
    engine.load_weights(model)
    ids = prompts(tok)
    params = SamplingParams(
        num_generations=2, max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=0, do_sample=False
    )
    ours, theirs = sample_completions(model, ids, params), engine.generate(ids, params)
    assert rows_of(theirs) == rows_of(ours)
    assert torch.equal(theirs.prompt_ids, ours.prompt_ids) and torch.equal(theirs.is_truncated, ours.is_truncated)
    sampled = SamplingParams(num_generations=4, max_new_tokens=8, eos_token_ids=(EOS,), pad_token_id=0)
    once = engine.generate(ids, sampled, generator=torch.Generator().manual_seed(5))
    again = engine.generate(ids, sampled, generator=torch.Generator().manual_seed(5))
    assert torch.equal(once.completion_ids, again.completion_ids)  # the same generator state, the same samples
    assert len({tuple(r) for r in rows_of(once)}) > 1
    for row, (prompt, completion) in enumerate(zip([p for p in ids for _ in range(4)], rows_of(once))):
        expected = model_logps(model, [prompt], [completion])[0]  # temperature 1, no truncation: the model's own
        torch.testing.assert_close(once.sampling_logps[row, : len(completion)], expected, atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_after_a_grpo_step_the_server_scores_like_the_trained_model(server, tmp_path, request):
    tok = toy.build_tokenizer()
    trainer = GRPOTrainer(
        toy.build_model("small", tokenizer=tok, seed=4),
        digit_sum_reward,
        args=config(tmp_path, server[0]),
        train_dataset=toy.load_task("addition", kind="rl", n=16),
        processing_class=tok,
    )
    request.addfinalizer(trainer.close)  # releases the server (one run at a time) even when the test fails
    engine, ids = trainer.engine, prompts(tok, n=3)
    fixed = [tok("12")["input_ids"] + [EOS], tok("7")["input_ids"], tok("345")["input_ids"] + [EOS]]
    before = [t.clone() for t in model_logps(trainer.model, ids, fixed)]
    trainer.train()  # one step at lr 1e-2: the server synced before sampling, so it holds the pre-step weights
    after = model_logps(trainer.model, ids, fixed)
    assert max((a - b).abs().max().item() for a, b in zip(after, before)) > 1e-2  # the step moved the policy
    for s, b in zip(engine.score(ids, fixed), before):
        torch.testing.assert_close(s, b, atol=1e-4, rtol=0)
    synced = engine.pushed
    load_with_push_skipped(engine, trainer.model_wrapped)  # the planted "skip the sync"
    stale = engine.score(ids, fixed)
    assert max((s - a).abs().max().item() for s, a in zip(stale, after)) > 1e-2  # a skipped sync is seen
    assert engine.sync_unchanged is True  # and the weight-sync check says so
    engine.pushed = synced  # as if the planted push had not happened: the real one is checked too
    engine.load_weights(trainer.model_wrapped)
    assert engine.sync_unchanged is False
    for s, a in zip(engine.score(ids, fixed), after):
        torch.testing.assert_close(s, a, atol=1e-4, rtol=0)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "overrides, field", [(dict(size="base"), "hidden_size"), (dict(size="small", vocab_size=120), "vocab_size")]
)
def test_a_server_of_another_model_is_refused_in_one_line(server, overrides, field):
    size = overrides.pop("size")
    other = toy.build_model(size, tokenizer=toy.build_tokenizer(), **overrides)
    with pytest.raises(VLLMServerError) as info:
        VLLMServerEngine(other, server[0], timeout=600)
    message = str(info.value)
    assert server[0] in message and "serves another model" in message and field in message and "\n" not in message


@pytest.mark.vllm
def test_async_grpo_through_the_server_keeps_its_schedule_and_resumes_exactly(server, tmp_path):
    """max_staleness=1 with the server: a thread of the trainer drives it (the server's process samples), batch g
    from weights max(g - 1, 0); a run resumed from checkpoint-2 trains the uninterrupted run's weights bit for bit
    (the server samples the same tokens for the same weights and seed)."""
    tok = toy.build_tokenizer()
    overrides = dict(max_steps=4, max_staleness=1, save_strategy="steps", save_steps=2, logging_steps=1)

    def run(resume=None):
        trainer = GRPOTrainer(
            toy.build_model("small", tokenizer=tok, seed=4),
            digit_sum_reward,
            args=config(tmp_path, server[0], **overrides),
            train_dataset=toy.load_task("addition", kind="rl", n=64),
            processing_class=tok,
        )
        try:
            threads = torch.get_num_threads()
            trainer.train(resume_from_checkpoint=resume)
            assert torch.get_num_threads() == threads and trainer.rollout_sampler.producer.kind == "thread"
            return trainer, {k: v.clone() for k, v in trainer.model.state_dict().items()}
        finally:
            trainer.close()  # releases the server for the next run

    whole, final = run()
    ages = [h["async/staleness"] for h in whole.state.log_history if "async/staleness" in h]
    assert ages == [0, 1, 1, 1]
    _, resumed = run(resume=str(tmp_path / "run" / "checkpoint-2"))
    assert all(torch.equal(final[k], resumed[k]) for k in final)


@pytest.mark.vllm
def test_killing_the_server_mid_run_is_exit_2_one_line_and_the_last_checkpoint_intact(
    server, tmp_path, capsys, monkeypatch
):
    """`treadle train` with the server killed before the third generation: steps 1-2 and their checkpoints are
    done, the run ends with exit 2 and one line naming the URL, checkpoint-2 is complete and loads. Last in the
    module: it kills the module's server."""
    url, process = server
    (tmp_path / "rewards.py").write_text(
        "def varied(completion_ids, **kwargs):\n    return [float(sum(ids) % 5) for ids in completion_ids]\n"
    )
    (tmp_path / "run.yaml").write_text(
        json.dumps(
            dict(
                trainer="grpo",
                model="toy:small",
                dataset="toy:addition:64",
                reward_funcs=["rewards.py:varied"],
                output_dir=str(tmp_path / "run"),
                max_steps=6,
                per_device_train_batch_size=8,
                num_generations=4,
                max_completion_length=8,
                save_steps=1,
                logging_steps=1,
                disable_tqdm=True,
                use_vllm=True,
                vllm_mode="server",
                vllm_server_base_url=url,
                vllm_server_timeout=600,
            )
        )
    )
    calls, generate = [], VLLMServerEngine.generate

    def generate_then_die(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            process.kill()
            process.wait()
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(VLLMServerEngine, "generate", generate_then_die)
    capsys.readouterr()
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("treadle: error")]
    assert len(lines) == 1 and url in lines[0] and "stopped answering" in lines[0] and "--resume" in lines[0]
    newest = checkpoint.latest_checkpoint(str(tmp_path / "run"))
    assert newest is not None and newest.endswith("checkpoint-2") and checkpoint.is_complete(newest)
    checkpoint.load_checkpoint(newest, model=toy.build_model("small", tokenizer=toy.build_tokenizer()))


# ------------------------------------------------------------------------------- no vLLM needed
class StandIn(BaseHTTPRequestHandler):
    """Answers GET /health with the server's ``identity``, a claim with its run, and any other POST with HTTP 500
    (an engine that failed)."""

    def do_GET(self):
        body = json.dumps(self.server.identity).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        claim = self.path.startswith(("/claim", "/release"))
        body = request if claim else b"treadle: error: the engine failed"
        self.send_response(200 if claim else 500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    """(url, server) of a stand-in that answers toy tiny's identity until shut down."""
    model = toy.build_model("tiny", seed=0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    server.identity = {
        "server": SERVER_NAME,
        "protocol": PROTOCOL,
        "model": "toy:tiny",
        "config": model.config.to_dict(),
        "weights": {k: list(v.shape) for k, v in merged_state_dict(model).items()},
    }
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_no_server_at_the_url_is_one_line_naming_it_and_the_fix():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(VLLMServerError) as info:
        VLLMServerEngine(toy.build_model("tiny"), url, timeout=0.3)
    message = str(info.value)
    assert is_user_error(info.value) and "\n" not in message
    assert f"no vLLM server answered at {url}/health within vllm_server_timeout=0.3 s" in message
    assert "treadle vllm-serve" in message


def test_a_stand_in_of_another_model_is_refused_and_the_same_model_accepted(stand_in):
    url, _ = stand_in
    with pytest.raises(VLLMServerError, match="serves another model .'toy:tiny': vocab_size 103 .the policy's: 50"):
        VLLMServerEngine(toy.build_model("tiny", vocab_size=50), url, timeout=5)
    assert VLLMServerEngine(toy.build_model("tiny", seed=7), url, timeout=5).url == url  # other weights, same shapes


def test_identity_mismatch_names_a_weight_of_another_shape():
    model = toy.build_model("tiny")
    weights = merged_state_dict(model)
    name = "model.layers.0.mlp.up_proj.weight"
    identity = {"config": {}, "weights": {name: [7, 7]}}
    assert (
        identity_mismatch(identity, model, weights) == f"{name} of shape (7, 7) (the policy's: "
        f"{tuple(weights[name].shape)})"
    )
    assert identity_mismatch({"weights": {"extra.weight": [1]}}, model, weights).startswith("a weight extra.weight")
    assert identity_mismatch({"weights": {name: list(weights[name].shape)}}, model, weights) is None


def test_a_server_that_stops_answering_mid_run_is_one_line(stand_in):
    url, server = stand_in
    engine = VLLMServerEngine(toy.build_model("tiny"), url, timeout=5)
    params = SamplingParams(num_generations=1, max_new_tokens=2, eos_token_ids=(EOS,), pad_token_id=0)
    with pytest.raises(VLLMServerError, match=r"refused /generate \(HTTP 500: treadle: error: the engine failed\)"):
        engine.generate([[1, 5]], params)
    server.shutdown()
    server.server_close()
    with pytest.raises(VLLMServerError) as info:
        engine.generate([[1, 5]], params)
    message = str(info.value)
    assert f"the vLLM server at {url} stopped answering" in message and "--resume" in message and "\n" not in message


def server_run_config(tmp_path, url: str, **keys) -> None:
    """``tmp_path/run.yaml``: GRPO of toy tiny on toy addition through the vLLM server at ``url``; ``keys`` add or
    override settings."""
    keys.setdefault("max_completion_length", 8)  # toy tiny has 256 positions: 64 + 256 (the default) is refused
    config = dict(
        trainer="grpo",
        model="toy:tiny",
        reward_funcs=["treadle.toy.addition_reward"],
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_prompt_length=64,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        **keys,
    )
    (tmp_path / "run.yaml").write_text(json.dumps(config))


def test_treadle_train_with_no_server_exits_2_with_one_line(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    server_run_config(tmp_path, url, dataset="toy:addition:16", max_steps=1, vllm_server_timeout=0.2)
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("treadle: error: no vLLM server answered at " + url)


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("vllm_server_base_url", "localhost:8000", "must be an http:// URL"),
        ("vllm_server_port", 0, "vllm_server_port must be a port number"),
        ("vllm_server_timeout", 0, "vllm_server_timeout must be a number of seconds > 0"),
    ],
)
def test_config_refuses_server_settings_in_one_line(tmp_path, field, value, fragment):
    with pytest.raises(ValueError) as info:
        config(tmp_path, None, **{field: value})
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", [0, -1, float("inf"), True, "soon"])
def test_config_refuses_a_vllm_request_timeout_that_cannot_bound_a_wait(tmp_path, value):
    from treadle.trainers.grpo.trainer import GRPOConfig

    with pytest.raises(ValueError) as info:
        GRPOConfig(output_dir=str(tmp_path), vllm_request_timeout=value)
    assert str(info.value).startswith("vllm_request_timeout must be a number")


def test_server_url_is_the_base_url_or_host_and_port(tmp_path):
    assert server_url(config(tmp_path, "http://h:1/")) == "http://h:1"
    args = config(tmp_path, None, vllm_server_host="10.0.0.2", vllm_server_port=8123)
    assert server_url(args) == "http://10.0.0.2:8123"


def test_server_fields_are_trls_names_and_defaults():
    trl_config = pytest.importorskip("trl.trainer.grpo_config").GRPOConfig
    theirs = {f.name: f.default for f in dataclasses.fields(trl_config) if f.name.startswith("vllm_server_")}
    ours = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name.startswith("vllm_server_")}
    assert ours == theirs and len(ours) == 4


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_vllm_serve_refuses_a_port_outside_1_65535_before_anything_loads(capsys, monkeypatch, port):
    monkeypatch.setattr(vllm_serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["vllm-serve", "toy:tiny", "--port", port]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --port: port must lie in 1..65535, got " + repr(port) in err[0]
