"""scopedckpt's benchmarks, run from the repository root as ``python -m benchmarks.<module>``.

Not shipped and not part of the test suite. Each entry point writes its results to
``benchmarks/results/<name>.json``, and ``python -m benchmarks.docs`` renders the tables
of docs/benchmarks.md from those files (docs/benchmarks.md lists the commands).

Layout: :mod:`benchmarks.models` holds the models and step functions every section
shares, :mod:`benchmarks.timing` the interleaved rounds and paired ratios, and
:mod:`benchmarks.internals` every private scopedckpt name a measurement reaches for.
No module imports ``tests``, pytest, or an entry point (``run``, ``docs``).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: subprocesses start here
RESULTS = ROOT / "benchmarks" / "results"  # every section's JSON and plots
THREADS = 2  # torch threads of the multi-threaded sections, in every process they start
