"""treadle's benchmarks: what it costs against a bare PyTorch loop doing the same work, against the peers
(transformers.Trainer, TRL, vLLM) and against the machine's own matmul roof, measured in the same run.

Run from the repository's root, as modules of this package:

    python -m benchmarks                          # every benchmark, then all their tables (make bench)
    python -m benchmarks --quick                  # each one's quick mode: checks that everything runs
    python -m benchmarks.trainers --twin          # one benchmark; --help lists its options

Every benchmark is built on ``benchmarks.harness`` (the machine header, the allocator every contender runs in,
interleaved rounds, the roof, JSON out and the results log, benchmarks/results.jsonl). ``benchmarks.lab`` holds
one-off investigations on the same harness; their results are in the docs. Figures and the commands that produced
them: docs/performance.md and docs/demos.md; the dated history: docs/results-log.md.
"""
