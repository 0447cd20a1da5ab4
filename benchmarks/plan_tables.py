"""The memory-budget planner's table for docs/benchmarks.md, from ``results/plan.json``.

Kept apart from :mod:`benchmarks.tables` (``benchmarks.docs`` merges both ``TABLES``), so
that neither module grows past a screenful of renderers.
"""

from __future__ import annotations

from typing import Any

from .tables import Results, interval, table


def _mib(count: float) -> str:
    return f"{count / 2**20:.1f}"


def _versus(row: dict[str, Any], k: int) -> str:
    pair = row["plan_vs_torch"].get(f"every {k}")
    if pair is not None:
        return f"{pair[0]:.3f} ({interval(pair[1:])})"
    # No plan fits that peak: say by how much, and how the smallest plan compares.
    points = {p["label"]: p for p in row["points"]}
    torch_point, smallest = points[f"torch every {k}"], points["plan 0%"]
    over = (row["smallest_budget"] - torch_point["peak_bytes"]) / 1024
    return (
        f"no plan fits (smallest {over:.1f} KiB above; it takes "
        f"{smallest['step_s'] / torch_point['step_s']:.3f}× torch's time, medians)"
    )


def _predicted(rows: list[dict[str, Any]]) -> str:
    """How the predicted step-time ratios of the plans below the whole peak compare with the
    measured ones, to the thousandth."""
    pairs = [
        (round(p["predicted_ratio"], 3), round(p["ratio"], 3))
        for r in rows
        for p in r["points"]
        if p["kind"] == "plan" and p["label"] != "plan 100%"
    ]
    if not pairs:
        return ""
    above = max(predicted - measured for predicted, measured in pairs)
    below = max(measured - predicted for predicted, measured in pairs)
    under = sum(predicted < measured for predicted, measured in pairs)
    return (
        f"Predicted step time against measured, every plan but the 100 % ones: from {above:.3f}"
        f" above to {below:.3f} below the measured ratio, below it on {under} of {len(pairs)}."
    )


def plan_summary(results: Results) -> list[str]:
    """plan.json, one row per model: sizes, planning time, accuracy, plans against torch."""
    data = results["plan"]
    header = ["model", "blocks", "step ms", "peak MiB, no ckpt", "smallest plan MiB"]
    header += ["planning, steps", "worst peak error", "plan / torch every 1 (95 %)"]
    header += ["plan / torch every 2 (95 %)", "torch points dominating a plan"]
    rows = [
        [
            r["model"],
            r["blocks"],
            f"{r['plain_step_s'] * 1e3:.0f}",
            _mib(r["no_checkpoint_peak"]),
            _mib(r["smallest_budget"]),
            f"{r['planning_steps']:.2f}",
            f"{r['worst_peak_error']:.1%}",
            _versus(r, 1),
            _versus(r, 2),
            "; ".join(f"{t} over {p}" for t, p in r["dominated"]) or "none",
        ]
        for r in data["rows"]
    ]
    notes = [f"`{name}`: skipped ({why})." for name, why in data.get("skipped", {}).items()]
    facts = f"torch threads: {data['threads']}; {data['rounds']} rounds; {data['interval']}."
    predicted = _predicted(data["rows"])
    if predicted:
        facts += " " + predicted
    solver = data.get("solver_200_blocks_s")
    if solver:
        spans = ", ".join(f"{s * 1e3:.0f} ms at {b}" for b, s in solver.items())
        facts += f" The solver on 200 blocks of three choices (the budget across the feasible span): {spans}."
    return [*table(header, rows), "", *notes, facts]


def compile_budget(results: Results) -> list[str]:
    """compile_budget.json: every point's heap peak, step time and exactness, then each
    budget point against the fastest plan at an equal or lower peak."""
    data = results["compile_budget"]
    header = ["model", "point", "peak MiB (heap)", "step / compiled step (95 %)", "exact"]
    rows = [
        [r["model"], p["label"], _mib(p["peak_bytes"]), f"{p['ratio']:.3f} ({interval(p['interval'])})",
         _exact(p)]
        for r in data["rows"]
        for p in r["points"]
    ]  # fmt: skip
    against = []
    for r in data["rows"]:
        for a in r["against"]:
            cells = []
            for kind in ("compiled plan", "eager plan"):
                best = a[kind]
                cells.append(
                    "none fits"
                    if best is None
                    else f"{best['label']}: {best['ratio']:.3f} ({interval(best['interval'])})"
                )
            against.append([r["model"], a["budget"], _mib(a["peak_bytes"]), *cells])
    head = ["model", "compile's budget point", "its peak MiB", "fastest compiled plan at or"]
    head[-1] += " below it / budget point"
    head.append("fastest eager plan at or below it / budget point")
    quick = ["A quick run (`--quick`): fewer points and rounds."] if data.get("quick") else []
    facts = f"torch threads: {data['threads']}; {data['interval']}."
    facts += (
        " Exactness under `torch.use_deterministic_algorithms(True)`; peaks and times without it."
    )
    for r in data["rows"]:
        runs = ", ".join(f"{k} {'yes' if v else '**no**'}" for k, v in r["reproducible"].items())
        facts += f" {r['model']}, each reference run twice, bit for bit the same: {runs}."
        gap = r["nondeterministic"]
        same = "were bit for bit the same" if gap == 0 else f"differed by {gap:.1e}"
        facts += f" Deterministic algorithms off, two runs of it compiled as shipped {same}."
    return [*quick, *table(header, rows, left=2), "", *table(head, against, left=2), "", facts]


def _exact(point: dict[str, Any]) -> str:
    """A point's exactness cell: yes, or no with its largest relative difference."""
    return "yes" if point["exact"] else f"**no** ({point['difference']:.1e})"


TABLES = {"plan-summary": plan_summary, "compile-budget": compile_budget}
