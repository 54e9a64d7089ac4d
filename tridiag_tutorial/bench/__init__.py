"""The benchmark and accuracy harness, run from a clone::

    python -m tridiag_tutorial.bench.benchmarks --help
    python -m tridiag_tutorial.bench.accuracy --help

Each writes JSON rows with the machine's description; the chapters read the committed rows in
``notebooks/data``. ``import tridiag_tutorial`` does not import this package."""
