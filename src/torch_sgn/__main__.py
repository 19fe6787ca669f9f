"""``python -m torch_sgn``: the same as the ``torch-sgn`` command."""

import sys

from .experiments.cli import main

sys.exit(main())
