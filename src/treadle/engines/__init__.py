"""Rollout engines: what GRPO and its evaluation ask for completions (``engines.base``: the contract;
``engines.local``: the own KV-cached sampler, the first implementation; ``engines.vllm``: vLLM colocated, imported
only when ``use_vllm`` builds it; ``engines.vllm_client``: the client of ``treadle vllm-serve``, standard library
only, and ``engines.vllm_server``, its server half; ``engines.wire``: what crosses a process boundary, as
safetensors bytes)."""

from treadle.engines.base import RolloutEngine
from treadle.engines.local import LocalEngine
from treadle.engines.vllm import VLLMEngine
from treadle.engines.vllm_client import VLLMServerEngine

__all__ = ["LocalEngine", "RolloutEngine", "VLLMEngine", "VLLMServerEngine"]
