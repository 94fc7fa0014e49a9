"""vLLM as a rollout engine (``engines.base.RolloutEngine``), colocated: an in-process ``vllm.LLM`` on the policy's
device that holds its own copy of the weights (``use_vllm=True``, ``vllm_mode="colocate"``; docs/vllm.md).

- Start: the policy (a PEFT model merged, on a copy) is saved to a temporary folder that vLLM loads; treadle
  tokenises, so vLLM runs with ``skip_tokenizer_init`` and returns token ids. ``VLLM_ENABLE_V1_MULTIPROCESSING``
  defaults to 0 here: the engine runs in this process, so a weight sync is a call, not a transfer.
- ``load_weights(model)``: the policy's full state dict (gathered under FSDP2) goes into vLLM's model through
  ``WeightLoader`` (vLLM's ``worker_extension_cls``: named methods, no insecure serialisation), then the prefix
  cache is cleared (its blocks were computed with the old weights). A PEFT LoRA policy vLLM can serve
  (``engines.vllm_lora.lora_plan``) starts the engine on its base weights with ``enable_lora`` and from then on
  sends its adapter alone, as a LoRA request under a fresh id per sync; any other PEFT model sends its merged
  weights (base + the adapters' delta, computed without touching the trained model). ``last_sync`` counts what
  the last push sent (tensors, bytes).
- ``generate``: one vLLM request per distinct prompt with ``n = num_generations``, seeded from the caller's
  generator (the same generator state gives the same completions for the same weights); ``sampling_logps`` are
  vLLM's processed log-probs (``logprobs_mode="processed_logprobs"``: after temperature, top-k, top-p and the
  repetition penalty), the distribution each token was drawn from.
- Threads: every call into vLLM runs on one thread of the engine's own (``engine_thread``), not the caller's.
  On a CPU, libgomp (torch's OpenMP) lets idle pool threads spin for 300,000 rounds while a process's OpenMP
  threads fit its cores, and 100 once they outnumber them; a second pool (this thread's) makes them outnumber
  them, so vLLM's steps, with their serial Python between small parallel regions, no longer lose a core to a
  spinning worker when another process takes one (toy small under 1-2 busy processes: 81-2,024 tokens/s from the
  caller's thread, 2,944-5,915 from the engine's, docs/vllm.md#speed). Where the two pools' threads do not
  outnumber the cores the spin stays long (``OMP_WAIT_POLICY=PASSIVE`` before Python starts is then the lever).
  ``TREADLE_VLLM_ENGINE_THREAD=0`` calls vLLM from the caller's thread: on a quiet machine up to a fifth faster on
  toy small (7,885 against 6,430 tokens/s), on the real model within noise.
- EOS: vLLM is told the ids (``stop_token_ids``) and ignores its own notion (``ignore_eos``), so a completion stops
  exactly where the own sampler's would.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from treadle.engines.base import RolloutEngine
from treadle.engines.vllm_lora import adapter_tensors, lora_plan, lora_rank_bound, write_adapter
from treadle.errors import UserError
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput, check_prompts, left_pad
from treadle.models import unwrapped_for_generation

__all__ = [
    "SINGLE_TURN_ONLY",
    "VLLM_INSTALL",
    "VLLMEngine",
    "VLLMNotInstalled",
    "WeightLoader",
    "check_head_size",
    "engine_thread",
    "merged_state_dict",
    "require_vllm",
    "vllm_engine",
    "weight_sync_unchanged",
]

VLLM_INSTALL = (
    "pip install vllm (a GPU), or the CPU build with its pins: `make test-vllm` installs .venv-vllm "
    "from constraints-vllm.txt"
)
SINGLE_TURN_ONLY = (
    "use_vllm=True samples single-turn rollouts only: multi-turn rollouts (tools=, env_factory=) "
    "sample with the own sampler; set use_vllm=False for them"
)  # both vLLM engines' refusal


class VLLMNotInstalled(UserError, ImportError):
    """``use_vllm=True`` without vLLM installed: one line naming the install (exit 2 from the CLI)."""


def require_vllm():
    """The ``vllm`` package, imported on first use (optional: a multi-GB install that pins torch)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocated: the engine runs in this process
    try:
        import vllm
    except ImportError:
        raise VLLMNotInstalled(f"use_vllm=True needs vLLM, which is not installed: {VLLM_INSTALL}") from None
    return vllm


def check_head_size(config, vllm) -> None:
    """Refuse, in one line and before the engine's minute-long start, a model whose attention head size vLLM's CPU
    attention has no kernel for (vLLM 0.32: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512; toy tiny's 16 is
    not one, and vLLM would fail only once the engine is up). Other platforms' backends are left to vLLM."""
    try:  # optional, as require_vllm: these modules exist once vLLM is installed (their paths are vLLM 0.32's)
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return
    if not current_platform.is_cpu():
        return
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if not CPUAttentionBackend.supports_head_size(head):
        sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
        raise UserError(
            f"vLLM {vllm.__version__}'s CPU attention has no kernel for this model's head size {head} (it has "
            f"{sizes}): use a model with one of those head sizes (toy small's is 32), or sample with treadle's own "
            f"sampler (use_vllm: false)"
        )


def vllm_engine(model: nn.Module, args, *, multi_turn: bool = False) -> VLLMEngine:
    """The colocated engine ``GRPOTrainer.build_engine`` returns under ``use_vllm`` (a ``GRPOConfig``'s fields)."""
    if multi_turn:
        raise ValueError(SINGLE_TURN_ONLY)
    return VLLMEngine(
        model,
        max_model_length=args.vllm_max_model_length,
        seed=args.seed,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
    )


def engine_thread() -> ThreadPoolExecutor | None:
    """The one thread the colocated engine calls vLLM from (module docstring, "Threads"), or None when
    ``TREADLE_VLLM_ENGINE_THREAD=0`` asks for the caller's thread."""
    if os.environ.get("TREADLE_VLLM_ENGINE_THREAD", "1") == "0":
        return None
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-vllm")


class WeightLoader:
    """Methods vLLM mixes into its worker (``worker_extension_cls``), called by name through ``collective_rpc``."""

    def treadle_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load transformers-named tensors into the worker's model in place through vLLM's ``reload_weights``
        (it maps the names, fuses q/k/v and gate/up, and redoes the post-load processing, e.g. the CPU kernels'
        repacking, which a plain ``model.load_weights`` after start-up would miss); returns how many were given."""
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return len(weights)


def weights_fingerprint(weights: list[tuple[str, torch.Tensor]]) -> float:
    """A cheap fingerprint of a state dict (each tensor's float64 sum and norm, weighted by its position; no copy):
    equal weights, equal prints; an optimizer step that moves weights changes it (up to a coincidence)."""
    total = 0.0
    for i, (_, tensor) in enumerate(weights):
        total += (i + 1) * float(tensor.sum(dtype=torch.float64))
        total += (i + 1.5) * float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
    return total


def merged_state_dict(model: nn.Module, *, adapters: bool = True) -> dict[str, torch.Tensor]:
    """The weights a plain transformers model would hold: ``model``'s state dict, or for a model with LoRA layers
    (a PEFT model, or its base model with the adapters injected) the base weights plus each active adapter's
    delta (``modules_to_save`` copies in place of the originals), named as the base model names them. The model
    is left untouched (no merge and unmerge, which would not restore the weights bit for bit). ``adapters=False``:
    the base weights alone (what a LoRA engine starts from)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if (
            adapters
            and hasattr(module, "lora_A")
            and callable(getattr(module, "get_delta_weight", None))
            and not module.merged
        ):
            active = [a for a in module.active_adapters if a in module.lora_A]
            if active:
                deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in active)
    state = {}
    for key, tensor in base.state_dict().items():
        if "lora_" in key or ".original_module." in key:
            continue
        plain = key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        state[plain] = tensor + deltas[plain].to(tensor.dtype) if plain in deltas else tensor
    return state


def weight_sync_unchanged(logps_before: torch.Tensor, logps_after: torch.Tensor, *, atol: float = 0.0) -> bool:
    """Whether a rollout engine's log-probs of the same probe tokens ``(B, C)`` were left unchanged by a weight
    sync after an optimizer step (the sync did nothing; verl 7495). For an engine to call around ``load_weights``
    and report as ``sync_unchanged`` (GRPO hands it to ``HealthCallback.record_weight_sync``)."""
    return bool(torch.allclose(logps_before.float(), logps_after.float(), rtol=0.0, atol=atol))


class SyncChecked(RolloutEngine):
    """What both vLLM engines (in process, and ``engines.vllm_client`` over HTTP) share around the contract:
    single-turn rollouts only, the request checks, the seed drawn from the caller's generator, and the weight-sync
    check (health.py): a probe completion (prompt 0 and the last generation's first completion, every token after the
    first scored: a confident completion's log-probs alone may round to the same floats after a step), the last push's
    fingerprint and the last check's verdict (``sync_unchanged``, kept until the next check: an evaluation's sync may
    be the one that checked). A subclass provides ``push`` (the engine samples from ``weights`` once it returns) and
    ``score``."""

    probe: tuple[list[list[int]], list[list[int]]] | None = None
    pushed: float | None = None

    single_turn_only = SINGLE_TURN_ONLY

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        prompt_inputs: dict | None = None,
    ) -> GenerationOutput:
        """The request checked and seeded from the caller's generator (``check_request``), sampled by the subclass
        (``sample``), its first completion kept as the weight-sync check's probe."""
        seed = self.check_request(prompt_ids, prompt_inputs, generator)
        output = self.sample(prompt_ids, params, seed)
        self.remember_probe(prompt_ids, output)
        return output

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int | None) -> GenerationOutput:
        """``params.num_generations`` completions of each prompt from ``seed`` (None: unseeded)."""
        raise NotImplementedError(f"{type(self).__name__} must implement sample")

    @staticmethod
    def check_request(
        prompt_ids: list[list[int]], prompt_inputs: dict | None, generator: torch.Generator | None
    ) -> int | None:
        """Refuse what vLLM is not given (images), check the prompts; the request's seed (None: unseeded)."""
        if prompt_inputs:
            raise UserError(
                "use_vllm=True samples text prompts only: vLLM's multimodal input is not wired into treadle "
                "yet; set use_vllm: false to sample prompts with images with treadle's own sampler"
            )
        check_prompts(prompt_ids)
        if generator is None:
            return None
        return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))

    def remember_probe(self, prompt_ids: list[list[int]], output: GenerationOutput) -> None:
        text = list(prompt_ids[0]) + output.completion_ids[0, : int(output.completion_mask[0].sum())].tolist()
        self.probe = ([text[:1]], [text[1:]]) if len(text) > 1 else None

    def checked_push(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """``push`` the weights; when they differ from the last push, the probe's log-probs must change with them."""
        fingerprint = weights_fingerprint(weights)
        checked = self.probe is not None and self.pushed is not None and fingerprint != self.pushed
        before = self.score(*self.probe) if checked else None
        self.push(weights)
        if checked:
            self.sync_unchanged = weight_sync_unchanged(torch.cat(before), torch.cat(self.score(*self.probe)))
        self.pushed = fingerprint


class VLLMEngine(SyncChecked):
    """A colocated ``vllm.LLM`` behind the engine contract; ``close`` shuts it down and deletes its folder."""

    runner = None  # its thread (``engine_thread``); None: the caller's (ServedEngine's requests run in threads)

    def __init__(
        self,
        model: nn.Module,
        *,
        max_model_length: int | None = None,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        seed: int = 0,
    ):
        vllm = require_vllm()
        with unwrapped_for_generation(model) as inner:
            check_head_size(inner.config, vllm)
        folder = tempfile.mkdtemp(prefix="treadle-vllm-")
        self.lora = lora_plan(model)  # (PEFT model, adapter name, LoraConfig): adapters synced alone; None: merged
        with unwrapped_for_generation(model) as inner:
            inner.save_pretrained(
                folder, state_dict=merged_state_dict(inner, adapters=self.lora is None), safe_serialization=True
            )
            device, dtype = next(inner.parameters()).device, next(inner.parameters()).dtype
        self.start(
            vllm,
            folder,
            device=device,
            dtype=dtype,
            seed=seed,
            max_model_length=max_model_length,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=enable_sleep_mode,
        )
        self.runner = engine_thread()
        if self.lora is not None:  # the adapter's config once; its weights with each sync, from this one on
            self.lora[2].save_pretrained(os.path.join(self.folder, "adapter"))
            self.load_weights(model)

    def start(
        self,
        vllm,
        folder: str,
        *,
        device: torch.device,
        dtype,
        seed: int,
        max_model_length: int | None,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
        enable_sleep_mode: bool = False,
    ) -> None:
        """Start the in-process ``vllm.LLM`` on the model saved in ``folder`` as both vLLM engines run it: treadle
        tokenises, the log-probs are vLLM's processed ones, weights arrive through ``WeightLoader``, and a LoRA plan
        (``self.lora``) serves its adapters."""
        self.folder, self.device, self._vllm = folder, device, vllm
        self.sleep_mode, self.sleeping = enable_sleep_mode, False
        self.lora_request = None  # the adapter's current vllm LoRARequest (a fresh lora_int_id per sync)
        self.last_sync: dict | None = None  # what the last push sent: {"kind": "full" | "lora", "tensors", "bytes"}
        lora = (
            {}
            if self.lora is None
            else dict(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_bound(self.lora[2]))
        )
        self.llm = vllm.LLM(
            model=os.path.abspath(folder),
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_length,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
            max_logprobs=0,
            worker_extension_cls=f"{__name__}.WeightLoader",
            **lora,
        )

    # ---- the contract ------------------------------------------------------------------------------------
    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int | None) -> GenerationOutput:
        self._wake()
        requests = [
            self.vllm_params(params, None if seed is None else seed + 7919 * i) for i in range(len(prompt_ids))
        ]
        outputs = self.call(
            self.llm.generate,
            [{"prompt_token_ids": list(p)} for p in prompt_ids],
            requests,
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        if self.sleep_mode:  # the optimizer step runs next: free the engine's memory until the next sync
            self.llm.sleep(level=1)
            self.sleeping = True
        return self._to_output(prompt_ids, outputs, params)

    def load_weights(self, model, version: int | None = None) -> None:
        """Push the policy's weights, and check the push (``sync_unchanged``): when they differ from the last push,
        the engine's log-probs of one probe completion (the last generation's first) must change with them."""
        self._wake()
        with unwrapped_for_generation(model) as inner:
            self.checked_push(list(self.sync_weights(model, inner).items()))
        self.policy_version = version

    def sync_weights(self, model: nn.Module, inner: nn.Module) -> dict[str, torch.Tensor]:
        """What a sync sends: the LoRA adapter's tensors (a LoRA engine), else the merged state dict."""
        if self.lora is None:
            return {name: tensor.detach() for name, tensor in merged_state_dict(inner).items()}
        plan = lora_plan(model)
        if plan is None or plan[1:] != self.lora[1:]:
            raise ValueError(
                "this vLLM engine was started for a LoRA policy's adapters and was given another model; "
                "build a new engine (GRPOTrainer.build_engine) for it"
            )
        return adapter_tensors(inner, plan[0], plan[1])

    def push(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load ``weights`` into the engine's model in place (the worker extension below), or under LoRA write the
        adapter and register it with vLLM under a fresh id (loaded now, the last sync's adapter removed); then clear
        the prefix cache, whose blocks hold keys and values of the old weights."""
        self.last_sync = {
            "kind": "full" if self.lora is None else "lora",
            "tensors": len(weights),
            "bytes": sum(t.numel() * t.element_size() for _, t in weights),
        }
        if self.lora is None:
            self.call(self.llm.collective_rpc, "treadle_load_weights", args=(weights,))
        else:
            self._register_adapter(weights)
        self.llm.reset_prefix_cache()

    def _register_adapter(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.lora.request import LoRARequest  # optional, as require_vllm; imported once vLLM is

        folder = os.path.join(self.folder, "adapter")
        write_adapter(folder, dict(weights))
        old, number = self.lora_request, 1 if self.lora_request is None else self.lora_request.lora_int_id + 1
        self.lora_request = LoRARequest(f"treadle-policy-{number}", number, folder)
        self.llm.llm_engine.add_lora(self.lora_request)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)

    def close(self) -> None:
        self.shutdown()
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        shutil.rmtree(self.folder, ignore_errors=True)

    def call(self, function, *args, **kwargs):
        """``function(*args, **kwargs)`` (a call into vLLM) on the engine's thread, or here without one."""
        if self.runner is None:
            return function(*args, **kwargs)
        return self.runner.submit(function, *args, **kwargs).result()

    def shutdown(self) -> None:
        """Stop the ``vllm.LLM`` (its engine core's processes and memory); the engine is not used again."""
        llm, self.llm = getattr(self, "llm", None), None
        shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- beyond the contract -----------------------------------------------------------------------------
    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """Each completion's per-token log-probs under the engine's current weights (temperature 1, no
        truncation): what the weight-sync checks compare with the trainer's."""
        self._wake()
        request = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        texts = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_ids, completion_ids)]
        # under LoRA one sequence per call: vLLM 0.32's LoRA logits layer indexes its adapters per request, not per
        # prompt position, and fails on prompt log-probs of a batch of several ("subscript b has size 3 ...")
        batches = [texts] if self.lora_request is None else [[text] for text in texts]
        outputs = [
            out
            for batch in batches
            for out in self.call(self.llm.generate, batch, request, use_tqdm=False, lora_request=self.lora_request)
        ]
        scored = []
        for prompt, out in zip(prompt_ids, outputs):
            ids = out.prompt_token_ids
            entries = out.prompt_logprobs[len(prompt) :]
            scored.append(torch.tensor([e[t].logprob for e, t in zip(entries, ids[len(prompt) :])]))
        return scored

    def vllm_params(self, params: SamplingParams, seed: int | None):
        """``params`` as vLLM's ``SamplingParams`` for one prompt (``n`` completions, sampled log-probs). vLLM applies
        ``min_p`` after temperature and before top-k / top-p (transformers: after them); the two orders keep the
        same tokens unless ``top_p < 1`` is set too, where vLLM's nucleus is taken over the min-p survivors."""
        if params.suppress_token_ids:
            raise UserError(
                "generation_kwargs' suppress_tokens reach treadle's own sampler only (vLLM takes no "
                "suppress list); unset it or set use_vllm: false"
            )
        return self._vllm.SamplingParams(
            n=params.num_generations if params.do_sample else 1,
            max_tokens=params.max_new_tokens,
            seed=seed,
            temperature=params.temperature if params.do_sample else 0.0,
            top_p=params.top_p if params.do_sample else 1.0,
            top_k=params.top_k if params.do_sample else 0,
            min_p=params.min_p if params.do_sample else 0.0,
            repetition_penalty=params.repetition_penalty,
            stop_token_ids=list(params.eos_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )

    def _wake(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def _to_output(self, prompt_ids: list[list[int]], outputs, params: SamplingParams) -> GenerationOutput:
        """vLLM's request outputs as a ``GenerationOutput`` (rows grouped by prompt, as the own sampler's)."""
        tokens, logps, truncated = [], [], []
        for out in outputs:
            copies = params.num_generations // len(out.outputs)  # greedy: vLLM decodes once (n must be 1), G copies
            for completion in [c for c in sorted(out.outputs, key=lambda c: c.index) for _ in range(copies)]:
                ids = list(completion.token_ids)
                tokens.append(ids)
                logps.append([entry[t].logprob for entry, t in zip(completion.logprobs, ids)])
                truncated.append(not (ids and ids[-1] in params.eos_token_ids))
        width = max(1, max(len(ids) for ids in tokens))
        completion_ids = torch.full((len(tokens), width), params.pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros((len(tokens), width), dtype=torch.long)
        sampling_logps = torch.zeros((len(tokens), width), dtype=torch.float32)
        for row, (ids, row_logps) in enumerate(zip(tokens, logps)):
            completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            completion_mask[row, : len(ids)] = 1
            sampling_logps[row, : len(ids)] = torch.tensor(row_logps, dtype=torch.float32)
        prompt, prompt_mask = left_pad(prompt_ids, params.pad_token_id)
        group = params.num_generations
        return GenerationOutput(
            prompt_ids=prompt.repeat_interleave(group, dim=0).to(self.device),
            prompt_mask=prompt_mask.repeat_interleave(group, dim=0).to(self.device),
            completion_ids=completion_ids.to(self.device),
            completion_mask=completion_mask.to(self.device),
            is_truncated=torch.tensor(truncated, dtype=torch.bool, device=self.device),
            sampling_logps=sampling_logps.to(self.device),
        )
