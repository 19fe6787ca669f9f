"""The experiment tooling around the optimizer: the paper's networks and data sets, the
benchmark runner, its report and the ``torch-sgn`` command line.

Importing :mod:`torch_sgn` does not import this package. It needs the ``experiments`` extra
(``pip install "torch-sgn[experiments]"``: numpy, tqdm, matplotlib).

Modules:
    models: the paper's networks and initialisations (:data:`~.models.PRESETS`).
    data: the data sets, their scaling and splits, found on disk or downloaded.
    config: a run's configuration and each optimizer's options.
    grids: the paper's benchmarks as grids of runs.
    optimizers: SGN, SGD and Adam behind the one interface the training loop uses.
    records: the files a run writes (atomically) and the environment it records.
    runner: one run or a grid of runs, resumable, with per-epoch results.
    report: tables and plots of finished runs.
    cli: the ``torch-sgn`` command (``run``, ``grid``, ``report``).
"""

try:
    import numpy  # noqa: F401  (every module of the tooling reads or writes arrays with it)
except ImportError as error:  # the library installed without its experiments extra
    raise ImportError(
        "torch_sgn.experiments (the torch-sgn command) needs its extra: pip install "
        '"torch-sgn[experiments]" (numpy, tqdm, matplotlib)'
    ) from error
