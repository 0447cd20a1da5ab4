"""The memory-budget planner's tables for docs/benchmarks.md, from ``results/plan.json``.

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
    solver = data.get("solver_200_blocks_s")
    if solver:
        spans = ", ".join(f"{s * 1e3:.0f} ms at {b}" for b, s in solver.items())
        facts += f" The solver on 200 blocks of three choices (the budget across the feasible span): {spans}."
    return [*table(header, rows), "", *notes, facts]


def plan_points(results: Results) -> list[str]:
    """plan.json, every point of every model, by peak: measured and predicted."""
    header = ["model", "point", "peak MiB", "predicted MiB", "step / no ckpt", "95 % interval"]
    header += ["predicted", "choices"]
    rows = []
    for r in results["plan"]["rows"]:
        for i, p in enumerate(sorted(r["points"], key=lambda p: p["peak_bytes"])):
            planned = p["kind"] == "plan"
            rows.append(
                [
                    r["model"] if i == 0 else "",
                    p["label"],
                    _mib(p["peak_bytes"]),
                    _mib(p["predicted_peak"]) if planned else "",
                    f"{p['ratio']:.3f}",
                    interval(p["interval"]),
                    f"{p['predicted_ratio']:.3f}" if planned else "",
                    "".join(c[0] for c in p["choices"]) if planned else "",
                ]
            )
    key = (
        "Choices, one letter per block in forward order: n none, f full, m matmuls, a attention, "
        "c convolutions (or compute, whichever the block's ops make distinct)."
    )
    return [*table(header, rows, left=2), "", key]


TABLES = {"plan-summary": plan_summary, "plan-points": plan_points}
