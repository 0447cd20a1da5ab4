"""The project's performance targets, each checked against the results files.

A :class:`Target` names a limit and where its values come from; the ``targets`` table
of docs/benchmarks.md shows, for each, the values measured (per model, their range
over depths or sizes) and whether every one is within the limit. The status is
computed, never typed: a new results file moves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .tables import Results, table

Values = dict[str, list[float]]


@dataclass(frozen=True)
class Target:
    """``text``: the promise; ``values``: label to the values it covers; met when every
    value is at most ``limit``."""

    text: str
    source: str
    values: Callable[[Any], Values]
    limit: float
    digits: int = 3


def _rows(key: str, models: tuple[str, ...] | None = None, depth: int | None = None) -> Any:
    def values(data: Any) -> Values:
        out: Values = {}
        for r in data["rows"]:
            if (models is None or r["model"] in models) and depth in (None, r["depth"]):
                out.setdefault(r["model"], []).append(r[key])
        return out

    return values


def _saved_c_over_b(data: Any) -> Values:
    out: Values = {}
    for r in data["rows"]:
        out.setdefault(r["model"], []).append(r["saved_bytes"]["c"] / r["saved_bytes"]["b"])
    return out


def _dropout(sizes: tuple[str, ...]) -> Any:
    def values(data: Any) -> Values:
        return {size: [data["dropout_time_ratio"][size]["save"]] for size in sizes}

    return values


def _heap(data: Any) -> Values:
    return {k: [(v["c"] - v["b"]) * 1024] for k, v in data["peak_heap_in_use_mib"].items()}


def _small(data: Any) -> Values:
    return {r["model"]: [r["scopedckpt/torch"]] for r in data["rows"]}


def _report(data: Any) -> Values:
    return {k: [v["memory_report"]] for k, v in data["measurement_overheads"].items()}


def _plan_vs_torch(k: int) -> Any:
    def values(data: Any) -> Values:
        out: Values = {}
        for r in data["rows"]:
            pair = r["plan_vs_torch"].get(f"every {k}")
            out[r["model"]] = [pair[0] if pair is not None else float("inf")]  # inf: no plan fits
        return out

    return values


def _plan_key(key: str, count: bool = False) -> Any:
    def values(data: Any) -> Values:
        return {r["model"]: [len(r[key]) if count else r[key]] for r in data["rows"]}

    return values


def _solver(data: Any) -> Values:
    return {"200 blocks": list(data["solver_200_blocks_s"].values())}


LARGE = ("mlp", "transformer", "cnn")
TARGETS = (
    Target("(c)/(b) step time ≤ 0.95 on the MLP, transformer and CNN", "results",
           _rows("c/b", LARGE), 0.95),
    Target("the same, glibc's heap fixed", "fixed_heap", _rows("c/b", LARGE), 0.95),
    Target("(c)/(b) ≤ 1.00 on the small-op MLP at 8 blocks", "results",
           _rows("c/b", ("small_mlp",), 8), 1.00),
    Target("the same, glibc's heap fixed", "fixed_heap", _rows("c/b", ("small_mlp",), 8), 1.00),
    Target("(d)/(a) ≤ 1.02 on every model", "results", _rows("d/a"), 1.02),
    Target("the same, glibc's heap fixed", "fixed_heap", _rows("d/a"), 1.02),
    Target("scoped `Dropout` ≤ 1.10 × `nn.Dropout` at 64 × 64", "results",
           _dropout(("64x64",)), 1.10, 2),
    Target("scoped `Dropout` ≤ 0.90 × `nn.Dropout` at ≥ 256 × 256", "results",
           _dropout(("256x256", "1024x1024")), 0.90, 2),
    Target("peak heap in use (c) − (b) ≤ 0 KiB on every model", "results", _heap, 0.0, 1),
    Target("step time with `memory_report()` ≤ 1.05 × without", "results", _report, 1.05),
    Target("saved for backward (c)/(b) ≤ 1, every model and depth", "results", _saved_c_over_b, 1.0),
    Target("scopedckpt/torch ≤ 1.00 on the small models (one thread)", "small_models", _small, 1.00),
    Target("plan at torch's every-block peak: step ≤ 0.97 × torch's", "plan",
           _plan_vs_torch(1), 0.97),
    Target("plan at torch's every-2nd-block peak: step ≤ 1.00 × torch's", "plan",
           _plan_vs_torch(2), 1.00),
    Target("no torch point both smaller and faster than a plan (pairs)", "plan",
           _plan_key("dominated", count=True), 0, 0),
    Target("measured peak within 10 % of the predicted, every plan", "plan",
           _plan_key("worst_peak_error"), 0.10),
    Target("planning (profile + solve) ≤ 2 steps without checkpointing", "plan",
           _plan_key("planning_steps"), 2.0, 2),
    Target("the solver on 200 blocks ≤ 1 s", "plan", _solver, 1.0),
)  # fmt: skip


def _span(values: list[float], digits: int) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if low == high else f"{low:.{digits}f}–{high:.{digits}f}"


def render(results: Results) -> list[str]:
    """The ``targets`` table: target, results file, values per label, status."""
    rows = []
    for target in TARGETS:
        values = target.values(results[target.source])
        measured = "; ".join(f"{k} {_span(v, target.digits)}" for k, v in values.items())
        missed = [k for k, v in values.items() if max(v) > target.limit]
        status = f"not met: {', '.join(missed)}" if missed else "met"
        rows.append([target.text, f"`{target.source}.json`", measured, status])
    return table(["target", "from", "measured (min–max per model or size)", "status"], rows, 4)
