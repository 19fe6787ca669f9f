"""``python -m torch_sgn``: the same as the ``torch-sgn`` command."""

from .experiments.cli import command

command()
