"""The rules of GRPOConfig's vLLM fields (``use_vllm``, ``vllm_*``; TRL 1.16's names), checked when the config is
built so that a bad setting fails before a model loads; ``engines.vllm`` holds the engine itself."""

from __future__ import annotations

import math

__all__ = ["VLLM_MODES", "check_server_options", "check_vllm_options"]

VLLM_MODES = ("colocate", "server")


def check_vllm_options(args) -> None:
    """Raise ValueError, in one line naming the field and the fix, for a vLLM setting that cannot run."""
    if args.vllm_mode not in VLLM_MODES:
        raise ValueError(f"vllm_mode={args.vllm_mode!r} is not supported; use one of {list(VLLM_MODES)}")
    if not 0.0 < args.vllm_gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"vllm_gpu_memory_utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization!r}; "
            f"e.g. 0.3 (TRL's default)"
        )
    if not isinstance(args.vllm_tensor_parallel_size, int) or args.vllm_tensor_parallel_size < 1:
        raise ValueError(f"vllm_tensor_parallel_size must be an integer >= 1, got {args.vllm_tensor_parallel_size!r}")
    length = args.vllm_max_model_length
    if length is not None and (not isinstance(length, int) or length < args.max_completion_length + 1):
        raise ValueError(
            f"vllm_max_model_length={length!r} leaves no room for a prompt and max_completion_length="
            f"{args.max_completion_length} tokens; set it to at least the longest prompt plus "
            f"max_completion_length, or None (the model's context)"
        )
    check_server_options(args)


def check_server_options(args) -> None:
    """The ``vllm_server_*`` fields (read only under ``vllm_mode="server"``; checked always: a typo fails early)."""
    url = args.vllm_server_base_url
    if url is not None and (
        not isinstance(url, str)
        or not url.startswith(("http://", "https://"))
        or not url.split("://", 1)[1].strip("/")
    ):
        raise ValueError(
            f"vllm_server_base_url must be an http:// URL such as http://localhost:8000 (where "
            f"`treadle vllm-serve` listens), got {url!r}"
        )
    port = args.vllm_server_port
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(
            f"vllm_server_port must be a port number in 1..65535, got {port!r}; e.g. 8000 (TRL's default)"
        )
    for name, example in (("vllm_server_timeout", "240 (TRL's)"), ("vllm_request_timeout", "1800")):
        timeout = getattr(args, name)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"{name} must be a number of seconds > 0, got {timeout!r}; e.g. {example}")
