"""The vLLM server's client (treadle.engines.vllm_client.VLLMServerEngine) against servers that misbehave, without
vLLM: one that accepts and never answers, one stopped with SIGSTOP, SIGTERM while a request waits, garbage and foreign
answers, two runs on one server, a model that differs beyond shapes, and a context window too short for prompt and
completion. The client against a real server, its settings and ``treadle vllm-serve``'s: test_vllm_server.py;
docs/runs.md lists the trial cases.

The servers here are stand-ins: ``treadle.engines.vllm_server.Handler`` itself around a fake engine (the real routes,
claims and identity, the toy model's own sampler instead of vLLM), a script in a subprocess (so that it can be
stopped), or a bare socket that accepts and never answers.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from _vllm_common import one_line
from test_vllm_server import server_run_config

from treadle import checkpoint
from treadle.callbacks import PreemptionCallback
from treadle.cli import command as cli
from treadle.demos import toy
from treadle.engines import vllm_client, vllm_server, wire
from treadle.engines.vllm_client import VLLMServerEngine, VLLMServerError
from treadle.errors import Preempted
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import sample_completions

EOS = 2
PARAMS = SamplingParams(num_generations=2, max_new_tokens=3, eos_token_ids=(EOS,), pad_token_id=0)


class FakeEngine:
    """What ``vllm_server.Handler`` calls on its engine, answered by a toy model on the CPU (no vLLM)."""

    def __init__(self, model):
        self.model = model
        self.llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_config=types.SimpleNamespace()))

    preempt_at: int | None = None  # the generation during which SIGTERM arrives (it then never answers)
    generations = 0

    def generate(self, prompt_ids, params, *, generator=None):
        self.generations += 1
        if self.generations == self.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's process (this test's): it waits for this answer
            self.released.wait(30)
        return sample_completions(self.model, prompt_ids, params, generator=generator)

    def score(self, prompt_ids, completion_ids):
        return [torch.zeros(len(c)) for c in completion_ids]

    def push(self, weights):
        self.model.load_state_dict(dict(weights), strict=False)


def tiny(seed: int = 0, **config):
    """Toy tiny with ``config``'s fields set on its config (what the identity check reads)."""
    model = toy.build_model("tiny", seed=seed)
    for key, value in config.items():
        setattr(model.config, key, value)
    return model


@contextlib.contextmanager
def treadle_server(tmp_path, *, max_model_len=256, **config):
    """The URL of ``vllm_server.Handler`` serving toy tiny (``config`` overrides its config) from a fake engine."""
    model = tiny(**config)
    folder = tmp_path / "served"
    model.save_pretrained(folder)
    engine = FakeEngine(model)
    engine.llm.llm_engine.model_config.max_model_len = max_model_len
    engine.released = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), vllm_server.Handler)
    server.engine, server.lock, server.pending, server.run = engine, threading.Lock(), {}, None
    server.identity = vllm_server.identity_of("toy:tiny", str(folder), "float32", engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", engine
    finally:
        engine.released.set()
        server.shutdown()
        server.server_close()
        thread.join()


class Scripted(BaseHTTPRequestHandler):
    """Answers each route as ``server.answers`` says: ``(status, body)``, or "hang" (never answers)."""

    protocol_version = "HTTP/1.1"

    def handle_route(self):
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
        answer = self.server.answers.get(self.path.split("?")[0], (404, b"not found"))
        if answer in ("hang", "sigterm"):
            if answer == "sigterm":  # the run is preempted while this request waits
                os.kill(os.getpid(), signal.SIGTERM)
            self.server.release.wait()
            return
        status, body = answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = handle_route

    def log_message(self, *args):
        pass


HEALTH = json.dumps({"server": "treadle vllm-serve", "protocol": wire.PROTOCOL, "max_model_len": 256}).encode()


@contextlib.contextmanager
def scripted(answers):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    server.daemon_threads = True
    server.answers, server.release = {"/health": (200, HEALTH), "/claim": (200, b"{}"), **answers}, threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join()


# ---- hang: every wait bounded by a named setting, SIGTERM answered -------------------------------------
def test_a_server_that_accepts_and_never_answers_generate_ends_naming_vllm_request_timeout():
    with scripted({"/generate": "hang"}) as url:
        engine = VLLMServerEngine(toy.build_model("tiny"), url, timeout=5, request_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(VLLMServerError) as info:
            engine.generate([[1, 5]], PARAMS)
        assert time.monotonic() - started < 4
    message = one_line(info.value)
    assert f"the vLLM server at {url} did not answer /generate within vllm_request_timeout=1 s" in message


def test_a_port_that_accepts_and_never_answers_health_ends_naming_vllm_server_timeout():
    with socket.socket() as listener:  # the kernel accepts connections; nothing ever reads or answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(VLLMServerError) as info:
            VLLMServerEngine(toy.build_model("tiny"), url, timeout=1.0)
        assert time.monotonic() - started < 4
    assert f"no vLLM server answered at {url}/health within vllm_server_timeout=1 s" in one_line(info.value)


STOPPABLE = textwrap.dedent(
    """
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    HEALTH = json.dumps({"server": "treadle vllm-serve", "protocol": PROTOCOL, "max_model_len": 256}).encode()
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            self.reply(HEALTH)
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path.startswith("/generate"):
                time.sleep(600)  # a long generation: the server stays alive, until it is stopped
            self.reply(b"{}")
        def reply(self, body):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(server.server_address[1], flush=True)
    server.serve_forever()
    """
).replace("PROTOCOL", str(wire.PROTOCOL))


def test_a_server_stopped_with_sigstop_mid_generation_is_found_by_the_health_probe(monkeypatch):
    monkeypatch.setattr(vllm_client, "PROBE_EVERY", 0.5)
    process = subprocess.Popen([sys.executable, "-c", STOPPABLE], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{process.stdout.readline().strip()}"
        engine = VLLMServerEngine(toy.build_model("tiny"), url, timeout=1.0)  # request_timeout: 1800 s
        threading.Timer(1.0, os.kill, (process.pid, signal.SIGSTOP)).start()  # while /generate waits
        started = time.monotonic()
        with pytest.raises(VLLMServerError) as info:
            engine.generate([[1, 5]], PARAMS)
        assert time.monotonic() - started < 6  # a second, the probe's interval and its vllm_server_timeout
    finally:
        process.kill()
        process.wait()
    message = one_line(info.value)
    assert f"the vLLM server at {url} stopped answering (/health gave no answer within vllm_server_timeout=1 s" in (
        message
    )
    assert "a stopped or hung server" in message and "--resume" in message


def test_sigterm_while_a_request_waits_stops_within_a_second_through_the_preemption_handler(capsys):
    preemption = PreemptionCallback()
    with scripted({"/generate": "hang"}) as url:
        engine = VLLMServerEngine(toy.build_model("tiny"), url, timeout=5)
        engine.policy_version = 4
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        with preemption.guard():
            timer.start()
            started = time.monotonic()
            with pytest.raises(Preempted) as info:
                engine.generate([[1, 5]], PARAMS)
            waited = time.monotonic() - started
        timer.join()
    assert waited < 3 and info.value.exit_status == 143 and info.value.step == 4
    assert preemption.signal == signal.SIGTERM  # the trainer's handler ran (it records the signal)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"treadle: SIGTERM while waiting for the vLLM server at {url} (/generate): the request is abandoned; the "
        f"run saves the steps it finished and stops"
    ]


def test_treadle_train_preempted_while_generate_waits_exits_143_at_once(tmp_path, capsys):
    with scripted({"/weights": (200, b"{}"), "/generate": "sigterm"}) as url:
        server_run_config(tmp_path, url, dataset="toy:addition:16", max_steps=2, max_completion_length=8)
        started = time.monotonic()
        assert cli.main(["train", str(tmp_path / "run.yaml")]) == 143
        assert time.monotonic() - started < 30  # the build, and a second after the signal (not 1,800 s)
    err = capsys.readouterr().err
    assert f"treadle: SIGTERM while waiting for the vLLM server at {url} (/generate)" in err
    assert "treadle: resume with: treadle train" in err and "Traceback" not in err


def test_sigterm_during_a_generation_saves_the_steps_finished_and_exits_143(tmp_path, capsys):
    """save_steps far away: the signal during step 3's generation abandons it, checkpoint-2 is written complete
    (before: the run waited for the answer, up to 1,800 s; ending at once without a save would lose steps 1-2)."""
    with treadle_server(tmp_path) as (url, engine):
        engine.preempt_at = 3
        server_run_config(
            tmp_path, url, dataset="toy:addition:32", max_steps=5, save_steps=100, max_completion_length=4
        )
        assert cli.main(["train", str(tmp_path / "run.yaml")]) == 143
    err = capsys.readouterr().err
    newest = checkpoint.latest_checkpoint(str(tmp_path / "run"))
    assert newest is not None and newest.endswith("checkpoint-2") and checkpoint.is_complete(newest)
    assert f"treadle: stopped by SIGTERM after step 2; checkpoint: {newest}" in err
    assert "treadle: resume with: treadle train" in err and "treadle: error" not in err  # (the in-process
    # stand-in server's thread prints a BrokenPipeError traceback when it answers the abandoned request)


# ---- a server answering garbage --------------------------------------------------------------------
@pytest.mark.parametrize(
    "route, body, said",
    [
        ("/generate", b"<html>Service Unavailable</html>", "'<html>Service Unavailable</html>'"),
        ("/score", b'{"wrong": "shape"}', """'{"wrong": "shape"}'"""),
        ("/score", b'{"logps": [[0.5]]}', """'{"logps": [[0.5]]}'"""),  # one row for two completions
    ],
)
def test_a_server_answering_garbage_is_one_line_naming_it_and_what_it_said(route, body, said):
    with scripted({route: (200, body)}) as url:
        engine = VLLMServerEngine(toy.build_model("tiny"), url, timeout=5)
        with pytest.raises(VLLMServerError) as info:
            if route == "/generate":
                engine.generate([[1, 5]], PARAMS)
            else:
                engine.score([[1], [1]], [[5, 6], [7]])
    message = one_line(info.value)
    assert f"the vLLM server at {url} answered {route} with what treadle cannot read" in message
    assert f"it sent {said}" in message


# ---- a foreign server ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "health, said",
    [
        ((200, b""), "HTTP 200 with an empty body"),  # vLLM's OpenAI-compatible `vllm serve`
        ((307, b""), "HTTP 307 with an empty body"),  # TRL's `trl vllm-serve` (FastAPI redirects to /health/)
        ((200, b'{"status":"ok"}'), """HTTP 200: '{"status":"ok"}'"""),  # TRL's /health/
        ((404, b"Not Found"), "HTTP 404: 'Not Found'"),
        ((200, b"\x00\xff garbage"), "HTTP 200: '"),
    ],
)
def test_a_foreign_server_is_refused_at_once_naming_what_answered(health, said):
    with scripted({"/health": health}) as url:
        started = time.monotonic()
        with pytest.raises(VLLMServerError) as info:
            VLLMServerEngine(toy.build_model("tiny"), url, timeout=60)
        assert time.monotonic() - started < 5  # at once, not after vllm_server_timeout
    message = one_line(info.value)
    assert f"the server at {url} is not treadle's vLLM server: GET /health answered {said}" in message
    assert "treadle vllm-serve MODEL --port PORT" in message


def test_an_older_treadle_server_without_claims_is_refused():
    old = json.dumps({"server": "treadle vllm-serve", "model": "toy:tiny", "config": {}, "weights": {}}).encode()
    with scripted({"/health": (200, old)}) as url, pytest.raises(VLLMServerError) as info:
        VLLMServerEngine(toy.build_model("tiny"), url, timeout=5)
    assert "speaks protocol 1" in one_line(info.value) and "restart it with this treadle" in str(info.value)


# ---- one server, one run; a model that differs beyond shapes -----------------------------------------
def test_a_second_run_is_refused_until_the_first_releases_the_server(tmp_path):
    with treadle_server(tmp_path) as (url, _):
        first = VLLMServerEngine(toy.build_model("tiny", seed=1), url, timeout=5, run="host:/runs/a")
        first.load_weights(toy.build_model("tiny", seed=1))
        assert first.generate([[1, 5, 6]], PARAMS).completion_ids.shape[0] == 2
        with pytest.raises(VLLMServerError) as info:
            VLLMServerEngine(toy.build_model("tiny", seed=2), url, timeout=5, run="host:/runs/b")
        message = one_line(info.value)
        assert f"the vLLM server at {url} refused /claim (HTTP 409: this server serves the run host:/runs/a" in (
            message
        )
        assert "start another `treadle vllm-serve` (another --port) for the run host:/runs/b" in message
        again = VLLMServerEngine(toy.build_model("tiny", seed=1), url, timeout=5, run="host:/runs/a")  # resumed
        again.close()
        second = VLLMServerEngine(toy.build_model("tiny", seed=2), url, timeout=5, run="host:/runs/b")
        with pytest.raises(VLLMServerError, match="HTTP 409: this server serves the run host:/runs/b"):
            first.generate([[1, 5, 6]], PARAMS)  # the first run's requests are refused now
        second.close()
        with pytest.raises(VLLMServerError, match=r"holds no run's claim \(was it restarted\?\)"):
            second.generate([[1, 5, 6]], PARAMS)  # as after a restart of the server mid-run
        status, said = vllm_client.exchange(url, "POST", "claim", b"[]", timeout=5)
        assert status == 400 and said == b"treadle: error: a claim names its run as {'run': RUN}, got []"


def test_the_run_id_is_the_output_folder_on_this_host(tmp_path):
    assert vllm_client.run_id(str(tmp_path / "run")) == f"{socket.gethostname()}:{tmp_path / 'run'}"


@pytest.mark.parametrize(
    "served, field",
    [
        (dict(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}), "rope"),
        (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_a_server_whose_model_differs_beyond_shapes_is_refused(tmp_path, served, field):
    with treadle_server(tmp_path, **served) as (url, _):
        with pytest.raises(VLLMServerError) as info:
            VLLMServerEngine(toy.build_model("tiny"), url, timeout=5)
        assert VLLMServerEngine(tiny(seed=5, **served), url, timeout=5).claimed
    message = one_line(info.value)
    assert f"the vLLM server at {url} serves another model ('toy:tiny': {field} " in message


def test_architecture_reads_rope_from_transformers_4_and_5_alike():
    four = {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "rms_norm_eps": 1e-6}
    five = {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}, "rms_norm_eps": 1e-6}
    assert wire.architecture(four) == wire.architecture(five)
    assert wire.architecture({"rope_theta": 1e4})["rope"] == {"rope_theta": 1e4, "rope_type": "default"}


# ---- a server's smaller max_model_len ------------------------------------------------------------------
def test_a_server_whose_context_cannot_hold_prompt_and_completion_is_named_at_connect_and_refused_per_prompt(
    tmp_path,
):
    with treadle_server(tmp_path, max_model_len=64) as (url, _):
        with pytest.raises(VLLMServerError) as refused:  # not even one prompt token fits
            VLLMServerEngine(toy.build_model("tiny"), url, timeout=5, max_prompt_length=8, max_completion_length=64)
        with pytest.warns(UserWarning) as warned:
            engine = VLLMServerEngine(
                toy.build_model("tiny"), url, timeout=5, max_prompt_length=60, max_completion_length=8
            )
        assert engine.generate([[1] * 56], SamplingParams(1, 8, eos_token_ids=(EOS,), pad_token_id=0))
        with pytest.raises(VLLMServerError) as cut:
            engine.generate([[1] * 57], SamplingParams(1, 8, eos_token_ids=(EOS,), pad_token_id=0))
        engine.close()
    assert "holds 64 tokens per sequence (its max_model_len), too few for a prompt and max_completion_length=64" in (
        one_line(refused.value)
    )
    (note,) = [str(w.message) for w in warned]
    assert (
        f"the vLLM server at {url} holds 64 tokens per sequence (its max_model_len) and max_prompt_length=60 + "
        in (note)
    )
    assert "a prompt longer than 56 tokens will stop the run (vLLM would cut its completion short)" in note
    assert "a prompt of 57 tokens + max_completion_length=8 does not fit in the 64 tokens" in one_line(cut.value)


# ---- the fourth hostile trial (issue 59): an identity that does not read, a host that is not this machine's -------
@pytest.mark.parametrize("field, value", [("max_model_len", "4096"), ("weights", [["lm_head.weight", [8, 4]]])])
def test_an_identity_of_the_wrong_types_is_one_line_not_a_traceback(field, value):
    identity = {
        "server": wire.SERVER_NAME,
        "protocol": wire.PROTOCOL,
        "model": "toy:tiny",
        "config": {},
        "weights": {},
    }
    body = json.dumps({**identity, "max_model_len": 64, field: value}).encode()
    with scripted({"/health": (200, body)}) as url, pytest.raises(VLLMServerError) as info:
        VLLMServerEngine(toy.build_model("tiny"), url, timeout=5)
    message = one_line(info.value)
    assert "an identity that does not read" in message and field in message


def test_vllm_serve_on_a_host_that_is_not_this_machines_names_the_host(capsys):
    # 192.0.2.1: TEST-NET-1 (RFC 5737), an address no machine is given
    assert cli.main(["vllm-serve", "toy:tiny", "--host", "192.0.2.1", "--port", "8123"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host 192.0.2.1 is not an address of this machine" in err[0]
    assert "another --port" not in err[0]


def test_a_generation_slower_than_the_health_probes_interval_after_the_first_is_checked_and_answered(
    tmp_path, monkeypatch
):
    """While a request waits, the client checks the server's /health every PROBE_EVERY seconds. The first generation
    keeps a completion for the weight-sync check in ``engine.probe``, which once hid the health check of the same
    name: every later request slower than PROBE_EVERY (30 s; a CPU generation under load) ended the run with
    "'tuple' object is not callable"."""
    monkeypatch.setattr(vllm_client, "PROBE_EVERY", 0.2)
    with treadle_server(tmp_path) as (url, served):
        engine = VLLMServerEngine(tiny(), url, timeout=5)
        first = engine.generate([[1, 5]], PARAMS)
        assert engine.probe is not None  # the weight-sync check's completion, kept
        checks, do_get = [], vllm_server.Handler.do_GET
        monkeypatch.setattr(vllm_server.Handler, "do_GET", lambda self: (checks.append(self.path), do_get(self)))
        fast = served.generate
        served.generate = lambda *args, **kwargs: (time.sleep(1.5), fast(*args, **kwargs))[1]
        second = engine.generate([[1, 5]], PARAMS)
    assert checks and set(checks) == {"/health"}  # asked while /generate waited, and answered
    assert second.completion_ids.shape == first.completion_ids.shape
