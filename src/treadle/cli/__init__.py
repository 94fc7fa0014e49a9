"""The ``treadle`` command line and every command of it: ``cli.command`` (parsing, the commands, the process
policy, one-line user errors), ``cli.registry`` (the trainers a config names, typed), ``cli.configfile`` (a config's
YAML read strictly), ``cli.loading`` (what a config names: datasets, models, reward functions), ``cli.report``
(``treadle report``) and ``cli.vllm_serve`` (``treadle vllm-serve``). ``main`` is the console script's entry
point."""

from treadle.cli.command import main

__all__ = ["main"]
