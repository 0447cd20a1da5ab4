"""The small-op MLP's ratios under each OpenMP thread setting, one subprocess each.

Run alone (about two minutes; writes ``benchmarks/results/threads.json``)::

    python benchmarks/threads.py

Why: on these 2-core machines the small-op MLP's (c)/(b) moved between runs by
more than anything scopedckpt changed, and ATen's CPU kernels run in OpenMP
parallel regions whose worker thread spins, then sleeps, between kernels, so
how long Python runs between kernels could change what every kernel costs.
This measures whether the thread setting moves the ratio. Each setting is a
fresh process (libgomp reads its environment once), timing (a)-(d)
interleaved on the small-op MLP at 8 blocks as ``run.py`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
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
    sys.path.insert(0, str(HERE))
    # Imported in the child only: each setting needs a fresh process.
    import run
    from breakdown import interleaved

    models = {c: run.build("small_mlp", depth, c) for c in ("a", "b", "c", "d")}
    median = interleaved(
        {c: (lambda m=m: run.step(*m)) for c, m in models.items()}, calls=1, rounds=rounds
    )
    return {
        "(c)/(b)": median["c"] / median["b"],
        "(d)/(a)": median["d"] / median["a"],
        "(b) ms": median["b"] * 1e3,
        "(c) - (b) per region, us": (median["c"] - median["b"]) / depth * 1e6,
    }


def main(depth: int = 8, rounds: int = 100) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, env in SETTINGS.items():
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(depth), str(rounds)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        row = results[name]
        print(
            f"{name:<52} (c)/(b) {row['(c)/(b)']:.3f}  (d)/(a) {row['(d)/(a)']:.3f}  "
            f"(b) {row['(b) ms']:.1f} ms  (c)-(b) {row['(c) - (b) per region, us']:+.0f} us/region"
        )
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        results = main()
        (HERE / "results" / "threads.json").write_text(json.dumps(results, indent=2) + "\n")
