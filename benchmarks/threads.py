"""The small-op MLP's ratios under each OpenMP thread setting, one subprocess each.

Run alone (writes ``benchmarks/results/threads.json``)::

    python -m benchmarks.threads [--quick]

Why: ATen's CPU kernels run in OpenMP parallel regions whose worker thread spins,
then sleeps, between kernels, so how long Python runs between kernels could change
what every kernel costs, and with it the small-op MLP's (c)/(b). This measures
whether the thread setting moves the ratio. Each setting is a fresh process (libgomp
reads its environment once), timing (a)-(d) interleaved on the small-op MLP at 8
blocks, as ``run.py``'s table times them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from . import RESULTS, ROOT

SETTINGS: dict[str, dict[str, str]] = {
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "2 threads (default spin, then sleep)": {"OMP_NUM_THREADS": "2"},
    "2 threads, OMP_WAIT_POLICY=PASSIVE (sleep at once)": {
        "OMP_NUM_THREADS": "2",
        "OMP_WAIT_POLICY": "PASSIVE",
    },
    "2 threads, OMP_WAIT_POLICY=ACTIVE (always spin)": {
        "OMP_NUM_THREADS": "2",
        "OMP_WAIT_POLICY": "ACTIVE",
    },
}


def _child(depth: int, rounds: int) -> dict[str, float]:
    # Imported in the child only: each setting needs a fresh process.
    from . import models
    from .timing import interleaved

    built = {c: models.build("small_mlp", depth, c) for c in ("a", "b", "c", "d")}
    median = interleaved(
        {c: (lambda m=m: models.step(*m)) for c, m in built.items()}, calls=1, rounds=rounds
    )
    return {
        "(c)/(b)": median["c"] / median["b"],
        "(d)/(a)": median["d"] / median["a"],
        "(b) ms": median["b"] * 1e3,
        "(c) - (b) per region, us": (median["c"] - median["b"]) / depth * 1e6,
    }


def main(depth: int = 8, rounds: int = 100) -> dict[str, Any]:
    """Every setting in its own subprocess; prints and returns each one's ratios."""
    results: dict[str, Any] = {}
    for name, env in SETTINGS.items():
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.threads", "--child", str(depth), str(rounds)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        row = results[name]
        print(
            f"{name:<52} (c)/(b) {row['(c)/(b)']:.3f}  (d)/(a) {row['(d)/(a)']:.3f}  "
            f"(b) {row['(b) ms']:.1f} ms  (c)-(b) {row['(c) - (b) per region, us']:+.0f} us/region"
        )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds, results not written")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
    elif args.quick:
        main(rounds=5)
    else:
        (RESULTS / "threads.json").write_text(json.dumps(main(), indent=2) + "\n")
