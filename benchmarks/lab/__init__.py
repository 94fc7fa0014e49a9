"""One-off investigations on the benchmarks' harness (``benchmarks.harness``), kept so that the figures the docs quote
from them can be measured again: ``python -m benchmarks.lab.NAME``. They are not part of ``python -m benchmarks``
(``--lab`` adds their quick modes). Each says in its docstring which question it answered and where the answer is.
"""
