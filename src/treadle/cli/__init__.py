"""The ``treadle`` command line, in three rooms: ``cli.command`` (parsing, the commands, the trainer registry,
one-line user errors), ``cli.configfile`` (a config's YAML read strictly) and ``cli.loading`` (what a config
names: datasets, models, reward functions). ``main`` is the console script's entry point."""

from treadle.cli.command import main

__all__ = ["main"]
