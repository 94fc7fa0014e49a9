"""Peak memory of per-token log-probs, forward + backward: full log-softmax vs treadle's chunked version.

    python benchmarks/logprob_memory.py            # V = 128256, B x T = 8 x 1024, H = 1024
    python benchmarks/logprob_memory.py --small    # V = 32000, B x T = 2 x 1024, H = 512 (seconds)

Both versions compute ``logp[label]`` for N = B x T rows from hidden states ``(N, H)`` and an LM head
``(V, H)``, then back-propagate to both. "Full" is the usual recipe, ``log_softmax(hidden @ W.T).gather``;
"chunked" is ``treadle.logprobs.chunked_token_logps``.

What is measured: the peak of tensor memory allocated *during* the call, above what was live before it
(the inputs), in MiB; it includes the gradients of the hidden states and of the weight, which both
versions must produce.
- On CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
  ``memory_allocated`` before.
- On CPU: tracemalloc does not see torch's allocator and RSS is blurred by the C allocator's caching, so
  the script records every allocation and free of torch's CPU allocator with
  ``torch.profiler.profile(profile_memory=True)`` and takes the maximum of their running sum. This counts
  exactly the bytes held by tensors (the same quantity as CUDA's ``memory_allocated``); scratch memory
  that BLAS libraries allocate on their own is not included, in either version.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)
from _memory import MiB, peak_memory  # noqa: E402

from treadle.logprobs.tokens import chunked_token_logps  # noqa: E402


def full_logps(hidden, weight, labels):
    logits = hidden @ weight.t()  # (N, V)
    return torch.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None]).squeeze(1)


def make_inputs(n, vocab, hidden_size, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(n, hidden_size, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(device, dtype)
    weight.requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g).to(device)
    return hidden, weight, labels


def run(fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    fn(hidden, weight, labels).sum().backward()


def measure(fn, *inputs, device: str):
    """(peak MiB, seconds) of one forward + backward of ``fn`` on ``inputs``."""
    start = time.perf_counter()
    _, peak = peak_memory(lambda: run(fn, *inputs), device)
    return peak, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="V=32000, N=2x1024, H=512: a quick run")
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    vocab = args.vocab or (32000 if args.small else 128256)
    batch = args.batch or (2 if args.small else 8)
    hidden_size = args.hidden or (512 if args.small else 1024)
    dtype = getattr(torch, args.dtype)
    n = batch * args.seq

    inputs = make_inputs(n, vocab, hidden_size, dtype, args.device)

    def chunked(hidden, weight, labels):
        return chunked_token_logps(hidden, weight, labels, chunk_size=args.chunk_size)

    results, grads = {}, {}
    for name, fn in (("full log-softmax", full_logps), (f"chunked ({args.chunk_size} rows)", chunked)):
        results[name] = measure(fn, *inputs, device=args.device)
        grads[name] = (inputs[0].grad.float(), inputs[1].grad.float())
        inputs[0].grad = inputs[1].grad = None

    (full_name, (full_mib, full_s)), (chunk_name, (chunk_mib, chunk_s)) = results.items()
    g_full, g_chunk = grads.values()
    diff = max((a - b).abs().max().item() for a, b in zip(g_full, g_chunk))
    one_logits = n * vocab * 4 / MiB
    print(machine_header())
    print(
        f"device {args.device}, dtype {args.dtype}, V={vocab}, N={batch}x{args.seq}={n}, H={hidden_size}; "
        f"one float32 [N, V] tensor = {one_logits:.0f} MiB"
    )
    print(f"{'method':<24}{'peak above inputs (MiB)':>26}{'time (s)':>12}")
    for name, (mib, seconds) in results.items():
        print(f"{name:<24}{mib:>26.0f}{seconds:>12.2f}")
    print(f"ratio chunked / full: {chunk_mib / full_mib:.3f}   (goal <= 0.25)")
    print(f"max |grad difference| over hidden and weight: {diff:.2e}")


if __name__ == "__main__":
    main()
