"""One experiment harness: a benchmark script declares an :class:`Experiment` (its arms and
settings, read from ``benchmarks/presets/<name>.toml``, how a grid spec is built, run and
described, and its tables) and calls :func:`main`, which parses the common options, runs what
the results file lacks and writes the tables. :mod:`experiment.summary` holds the step-record
reductions and table rows the scripts share.
"""

from experiment.declare import Arm, Experiment, Preset, Results, load_preset
from experiment.main import main, parse_args, plan, run

__all__ = [
    "Arm",
    "Experiment",
    "Preset",
    "Results",
    "load_preset",
    "main",
    "parse_args",
    "plan",
    "run",
]
