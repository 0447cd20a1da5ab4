"""Memory and speed of scopedckpt against torch.utils.checkpoint and no checkpointing.

Run by hand from the repository root (not part of the test suite)::

    pip install -e ".[bench]"
    python -m benchmarks.run [--quick] [--compiled | --selective | --fixed-heap | --plan]

``--compiled`` runs only the torch.compile section instead (:mod:`benchmarks.compiled`),
``--selective`` only the selective-saving trade-off (:mod:`benchmarks.selective`),
``--plan`` only the memory-budget planner against torch's strategies (:mod:`benchmarks.plan`)
and against torch.compile's activation memory budget (:mod:`benchmarks.compile_budget`),
``--fixed-heap`` only the step-time table with glibc's heap trimming and dynamic
mmap threshold off in the workers (``FIXED_HEAP``, ``results/fixed_heap.json``).

The configurations (a)-(e) over the same regions (one per block) are those of
:mod:`benchmarks.models`; (c)/(e) is what replaying unscoped randomness costs the
converted fast path. Prints a table of ratios, writes ``results/results.json`` and
``results.png``. Step times: each configuration of a cell runs in its own worker
process (:mod:`benchmarks.workers`), stepped in interleaved rounds (a, b, c, d, e,
then b, c, d, e, a, ...), so that machine noise hits every configuration alike while
no configuration's step meets a heap the others left behind; ``ROUNDS_FACTOR`` times
as many rounds for the cheap small-op MLP. Peak RSS is measured per configuration in
its own subprocess (:mod:`benchmarks.memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

from . import RESULTS, THREADS, breakdown, dropout, memory, workers
from .models import CONFIGS, MODELS, NAMES
from .timing import paired

# More rounds where steps are cheap and a few percent is the question.
ROUNDS_FACTOR = {"small_mlp": 8}
RATIOS = (("c", "b"), ("c", "a"), ("d", "a"), ("c", "e"))


def measure(
    steppers: workers.StepWorkers, kind: str, depth: int, repeats: int
) -> dict[str, object]:
    """Step times of every configuration, each in its own worker process; ratios are
    paired (:func:`benchmarks.timing.paired`): the median over rounds of the two
    configurations' times in the same round."""
    times, faults, facts = steppers.rounds(kind, depth, repeats * ROUNDS_FACTOR.get(kind, 1))
    saved = {c: facts[c]["saved_bytes"] for c in CONFIGS}
    row: dict[str, object] = {
        "model": kind,
        "depth": depth,
        "rounds": len(times["a"]),
        "median_s": {c: statistics.median(t) for c, t in times.items()},
        "median_minor_faults": {c: statistics.median(f) for c, f in faults.items()},
        "saved_bytes": saved,
    }
    for numerator, denominator in RATIOS:
        median, low, high = paired(times, numerator, denominator)
        row[f"{numerator}/{denominator}"] = median
        row[f"{numerator}/{denominator} 95% interval"] = [low, high]
    row["saved c-b per dropout call"] = (saved["c"] - saved["b"]) / max(1, facts["c"]["dropouts"])
    return row


def step_table(depths: tuple[int, ...], repeats: int) -> list[dict[str, object]]:
    """Every model at every depth, in one set of workers (:mod:`benchmarks.workers`)."""
    rows = []
    with workers.StepWorkers(CONFIGS, THREADS) as steppers:
        for kind in MODELS:
            for depth in depths:
                rows.append(measure(steppers, kind, depth, repeats))
                print(f"measured {kind} depth {depth}", file=sys.stderr)
    return rows


def print_step_table(rows: list[dict[str, Any]]) -> None:
    """The step-time table: ratios, saved MiB and minor page faults per step."""
    print(
        "\nstep time ratios: paired medians over rounds, (c)/(b) with its 95 % interval;"
        " minor page faults per step, median"
        f"\n{'model':<12}{'depth':>6}{'rounds':>7}{'(c)/(b) time':>14}{'interval':>15}"
        f"{'(c)/(a)':>9}{'(d)/(a)':>9}{'(c)/(e)':>9}"
        f"{'saved MiB a':>13}{'b':>8}{'c':>8}{'d':>8}{'faults a':>10}{'b':>6}{'c':>6}{'d':>6}"
    )
    for r in rows:
        s, f = r["saved_bytes"], r["median_minor_faults"]
        low, high = r["c/b 95% interval"]
        print(
            f"{r['model']:<12}{r['depth']:>6}{r['rounds']:>7}{r['c/b']:>14.3f}"
            f"{f'{low:.3f}-{high:.3f}':>15}"
            f"{r['c/a']:>9.3f}{r['d/a']:>9.3f}{r['c/e']:>9.3f}"
            f"{s['a'] / 2**20:>13.2f}{s['b'] / 2**20:>8.2f}{s['c'] / 2**20:>8.2f}{s['d'] / 2**20:>8.2f}"
            f"{f['a']:>10.0f}{f['b']:>6.0f}{f['c']:>6.0f}{f['d']:>6.0f}"
        )


# glibc tunables, read when a process starts: blocks under 32 MiB (glibc's largest
# allowed threshold on 64-bit) come from the heap, setting it switches the dynamic
# threshold off, and the heap's top is not trimmed under 1 GiB free, so freed pages
# stay mapped and a step's page faults no longer depend on the heap's history.
FIXED_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def run_fixed_heap(depths: tuple[int, ...], repeats: int, quick: bool) -> None:
    """The step-time table with glibc's heap trimming and dynamic mmap threshold off."""
    os.environ.update(FIXED_HEAP)  # inherited by the spawned workers
    rows = step_table(depths, repeats)
    print(f"\nglibc tunables in the workers: {FIXED_HEAP}")
    print_step_table(rows)
    (RESULTS / "fixed_heap.json").write_text(
        json.dumps(
            {"rows": rows, "tunables": FIXED_HEAP, "quick": quick, "torch": torch.__version__},
            indent=2,
        )
    )


def _print_by_model(title: str, values: dict[str, dict[str, float]], fmt: str) -> None:
    print(title)
    for kind, row in values.items():
        names = {k: NAMES.get(k, k) for k in row}
        print(f"  {kind:<12}" + "  ".join(f"{names[k]}: {v:{fmt}}" for k, v in row.items()))


def run_all(quick: bool) -> None:
    """The step-time table, memory, measurement costs, dropout and the breakdown;
    writes ``results/results.json`` and ``results.png``."""
    repeats = 3 if quick else 21
    depths = (4, 8) if quick else (4, 8, 16, 32)
    rows = step_table(depths, repeats)
    rss, heap_peak, overheads = {}, {}, {}
    for kind in MODELS:
        depth = depths[-1]
        if not quick:  # a subprocess per configuration: most of --quick's time
            rss[kind] = {c: memory.peak_rss_mib(kind, depth, c) for c in CONFIGS}
        heap_peak[kind] = {c: memory.peak_heap_mib(kind, depth, c) for c in CONFIGS}
        overheads[kind] = memory.measurement_overheads(kind, depth, repeats)
    per_element = dropout.bytes_per_element()
    dropout_ratio = dropout.step_ratio(repeats * 4)
    print("\nwhere the remaining time goes (benchmarks/breakdown.py):")
    remaining = breakdown.main(rounds=5 if quick else 21)

    print_step_table(rows)
    _print_by_model(
        f"\npeak heap in use during a step at depth {depths[-1]} (MiB above the heap before "
        "it, mallinfo2 after every aten op):",
        heap_peak,
        ".2f",
    )
    _print_by_model(
        f"\npeak RSS a step adds at depth {depths[-1]} (MiB above the RSS before it, own "
        "subprocess; glibc's dynamic mmap threshold makes it vary, see docs/benchmarks.md):",
        rss,
        ".0f",
    )
    _print_by_model(
        "\nstep time of (c) with the heap sampler / memory_report() on, over off:",
        overheads,
        ".3f",
    )
    print("\ndropout alone, bytes kept for backward per element:")
    for name, value in per_element.items():
        print(f"  {name:<40}{value:.3f}")
    print("dropout alone, forward+backward time relative to nn.Dropout (save: save_mask=True):")
    for size, ratios in dropout_ratio.items():
        print(f"  {size:<12}" + ", ".join(f"{k}: {v:.2f}" for k, v in ratios.items()))
    (RESULTS / "results.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "peak_rss_mib": rss,
                "peak_heap_in_use_mib": heap_peak,
                "measurement_overheads": overheads,
                "dropout_bytes_per_element": per_element,
                "dropout_time_ratio": dropout_ratio,
                "breakdown": remaining,
                "quick": quick,
                "torch": torch.__version__,
            },
            indent=2,
        )
    )
    plot(rows)


def plot(rows: list[dict[str, Any]]) -> None:
    """Saved bytes and step time against depth, a column per model: ``results.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(MODELS), figsize=(4 * len(MODELS), 7))
    for col, kind in enumerate(MODELS):
        mine = [r for r in rows if r["model"] == kind]
        depths = [r["depth"] for r in mine]
        for c in CONFIGS:
            axes[0][col].plot(
                depths, [r["saved_bytes"][c] / 2**20 for r in mine], "o-", label=NAMES[c]
            )
            axes[1][col].plot(depths, [r["median_s"][c] * 1e3 for r in mine], "o-", label=NAMES[c])
        axes[0][col].set_title(kind)
        axes[0][col].set_ylabel("saved for backward (MiB)")
        axes[1][col].set_ylabel("step time (ms, median)")
        axes[1][col].set_xlabel("blocks")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "results.png", dpi=100)


def main() -> None:
    """``python -m benchmarks.run``: parse the flags, run one section."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sweep without peak RSS, a few minutes"
    )
    parser.add_argument(
        "--compiled", action="store_true", help="only the torch.compile section (compiled.py)"
    )
    parser.add_argument(
        "--selective", action="store_true", help="only the selective-saving section (selective.py)"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="only the memory-budget planner against torch's strategies and compile's budget",
    )
    parser.add_argument(
        "--fixed-heap",
        action="store_true",
        help="only the step-time table, with glibc's heap trimming and dynamic mmap "
        "threshold off in the workers (results/fixed_heap.json)",
    )
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    RESULTS.mkdir(exist_ok=True)
    # compiled and selective are imported only when run: every worker process imports
    # this module (multiprocessing's spawn), and none should load dynamo for nothing.
    if args.compiled:
        from . import compiled

        compiled.main(args.quick)
    elif args.selective:
        from . import selective

        selective.main(args.quick)
    elif args.plan:
        from . import compile_budget, plan

        plan.main(args.quick)
        compile_budget.main(args.quick)
    elif args.fixed_heap:
        repeats, depths = (3, (4, 8)) if args.quick else (21, (4, 8, 16, 32))
        run_fixed_heap(depths, repeats, args.quick)
    else:
        run_all(args.quick)


if __name__ == "__main__":
    main()
