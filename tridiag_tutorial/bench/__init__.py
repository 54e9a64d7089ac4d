"""The benchmark and accuracy harness, run from a clone::

    python -m tridiag_tutorial.bench.benchmarks --help
    python -m tridiag_tutorial.bench.accuracy --help

Each writes JSON rows with the machine's description; the chapters read the rows kept in
``notebooks/data``, and chapter 12 the few it quotes, which the package ships
(:mod:`tridiag_tutorial.bench.reference` extracts them), so that it runs opened alone.
``import tridiag_tutorial`` does not import this package."""
