"""Markdown tables rendered from ``benchmarks/results/*.json``, by name, for docs/benchmarks.md.

Each renderer takes the loaded results (:class:`Results`) and returns the table's
lines; ``TABLES`` maps the names used in the docs' ``<!-- generated: NAME -->``
markers to them. A table whose results file says ``"quick": true`` is preceded by a
line saying so. A renderer reads only what its file holds: every number in a table is
a value of a results file, rounded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from . import RESULTS

Row = Sequence[object]


class Results:
    """The results files of one directory, loaded on first use."""

    def __init__(self, directory: Path = RESULTS) -> None:
        self.directory = directory
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            path = self.directory / f"{name}.json"
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} is missing: run the benchmark that writes it "
                    "(docs/benchmarks.md, 'Commands'), or its --quick form"
                )
            self._loaded[name] = json.loads(path.read_text())
        return self._loaded[name]

    def names(self) -> list[str]:
        """Every results file's name, sorted."""
        return sorted(path.stem for path in self.directory.glob("*.json"))


def table(header: Sequence[str], rows: Iterable[Row], left: int = 1) -> list[str]:
    """A Markdown table; the first ``left`` columns left-aligned, the rest right-aligned.

    Example
    -------
    >>> table(["model", "ratio"], [["mlp", "0.91"]])
    ['| model | ratio |', '|---|---:|', '| mlp | 0.91 |']
    """
    rule = "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"
    return [_line(header), rule, *(_line([str(cell) for cell in row]) for row in rows)]


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def interval(pair: Sequence[float], digits: int = 3) -> str:
    """``low–high``."""
    return f"{pair[0]:.{digits}f}–{pair[1]:.{digits}f}"


def number(value: float) -> str:
    """Three significant places at most: ratios to the thousandth, µs to the unit."""
    size = abs(value)
    return f"{value:.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.3f}"


def _mib(count: float) -> str:
    return f"{count / 2**20:.1f}"


def _quick_note(data: dict[str, Any]) -> list[str]:
    if data.get("quick"):
        return ["*From a `--quick` run: a smoke test of the pipeline, not a measurement.*", ""]
    return []


CONFIGS = ("a", "b", "c", "d", "e")
_PARENS = [f"({c})" for c in CONFIGS]


def steps(results: Results) -> list[str]:
    """results.json's step-time table: ratios, saved MiB, minor faults per step."""
    data = results["results"]
    header = ["model", "blocks", "rounds", "(c)/(b) time", "95 % interval"]
    header += ["(c)/(a)", "(d)/(a)", "(c)/(e)", "saved MiB (a)", "(b)", "(c)", "(d)"]
    header += ["faults/step (a)", "(b)", "(c)", "(d)"]
    rows = []
    for r in data["rows"]:
        saved, faults = r["saved_bytes"], r["median_minor_faults"]
        rows.append(
            [
                r["model"],
                r["depth"],
                r["rounds"],
                f"{r['c/b']:.3f}",
                interval(r["c/b 95% interval"]),
            ]
            + [f"{r[k]:.2f}" for k in ("c/a", "d/a", "c/e")]
            + [_mib(saved[c]) for c in "abcd"]
            + [f"{faults[c]:.0f}" for c in "abcd"]
        )
    return _quick_note(data) + table(header, rows)


def fixed_heap(results: Results) -> list[str]:
    """fixed_heap.json: the step-time table with glibc's trimming and threshold fixed.

    The fault columns are left out, and said to be zero, when every count is zero.
    """
    data = results["fixed_heap"]
    faults = any(r["median_minor_faults"][c] for r in data["rows"] for c in CONFIGS)
    header = ["model", "blocks", "rounds", "(c)/(b) time", "95 % interval"]
    header += ["(c)/(a)", "(d)/(a)", "(c)/(e)"]
    header += ["faults/step (a)", "(b)", "(c)", "(d)", "(e)"] if faults else []
    rows = [
        [r["model"], r["depth"], r["rounds"], f"{r['c/b']:.3f}", interval(r["c/b 95% interval"])]
        + [f"{r[k]:.2f}" for k in ("c/a", "d/a", "c/e")]
        + ([f"{r['median_minor_faults'][c]:.0f}" for c in CONFIGS] if faults else [])
        for r in data["rows"]
    ]
    tunables = ", ".join(f"`{k}={v}`" for k, v in data["tunables"].items())
    note = f"glibc tunables in the workers: {tunables}."
    if not faults:
        note += " Minor page faults per timed step: 0 in every row and configuration."
    return [*_quick_note(data), note, "", *table(header, rows)]


def _by_config(values: dict[str, dict[str, float]], digits: int, depth: int) -> list[Row]:
    return [
        [kind, depth, *(f"{row[c]:.{digits}f}" for c in CONFIGS)] for kind, row in values.items()
    ]


def _deepest(data: dict[str, Any]) -> int:
    return max(r["depth"] for r in data["rows"])


def peak_heap(results: Results) -> list[str]:
    """results.json's peak heap in use during a step, MiB, at the deepest depth."""
    data = results["results"]
    values = data["peak_heap_in_use_mib"]
    depth = _deepest(data)
    rows = []
    for kind, row in values.items():
        ratio, kib = row["c"] / row["b"], (row["c"] - row["b"]) * 1024
        rows.append(
            [kind, depth, *(f"{row[c]:.2f}" for c in CONFIGS), f"{ratio:.3f}", f"{kib:.1f}"]
        )
    header = ["model", "blocks", *_PARENS, "(c)/(b)", "(c) − (b), KiB"]
    return _quick_note(data) + table(header, rows)


def peak_rss(results: Results) -> list[str]:
    """results.json's peak RSS a first step adds, MiB (not measured by --quick)."""
    data = results["results"]
    if not data["peak_rss_mib"]:
        return ["*Not measured: the results come from a `--quick` run.*"]
    rows = _by_config(data["peak_rss_mib"], 0, _deepest(data))
    return _quick_note(data) + table(["model", "blocks", *_PARENS], rows)


def overheads(results: Results) -> list[str]:
    """results.json: step time of (c) with each measurement on, over off."""
    data = results["results"]
    rows = [
        [
            kind,
            _deepest(data),
            f"{v['heap sampler']:.2f}",
            f"{v['memory_report']:.3f}",
            interval([v["memory_report 95% interval low"], v["memory_report 95% interval high"]]),
        ]
        for kind, v in data["measurement_overheads"].items()
    ]
    header = ["model", "blocks", "heap sampler", "memory_report()", "95 % interval"]
    return _quick_note(data) + table(header, rows)


def dropout(results: Results) -> list[str]:
    """results.json: dropout alone, bytes kept per element and time against nn.Dropout."""
    data = results["results"]
    kept = [[f"`{name}`", f"{v:.0f}"] for name, v in data["dropout_bytes_per_element"].items()]
    header = ["size", "`nn.Dropout`", "scoped, `save_mask=True`", "scoped, `save_mask=False`"]
    times = [
        [size, *(f"{r[k]:.2f}" for k in ("nn", "save", "regen"))]
        for size, r in data["dropout_time_ratio"].items()
    ]
    return (
        _quick_note(data)
        + table(["layer", "bytes kept per element"], kept)
        + ["", "Forward + backward time relative to `nn.Dropout`:", ""]
        + table(header, times)
    )


def _breakdown(section: str) -> Callable[[Results], list[str]]:
    def render(results: Results) -> list[str]:
        data = results["results"]
        values = data["breakdown"][section]
        return _quick_note(data) + table(
            ["measurement", "value"], [[k, number(v)] for k, v in values.items()]
        )

    render.__doc__ = f"results.json's breakdown: {section}."
    return render


def dropout_formulations(results: Results) -> list[str]:
    """results.json's breakdown: each formulation's time against nn.Dropout, by size."""
    data = results["results"]
    values = data["breakdown"]["dropout_formulations (relative to nn.Dropout)"]
    rows = [
        [size, f"{r['ATen ops']:.2f}", f"{r['autograd.Function']:.2f}"]
        for size, r in values.items()
    ]
    return _quick_note(data) + table(["size", "ATen ops", "`autograd.Function`"], rows)


def compiled(results: Results) -> list[str]:
    """compiled.json: ms per step compiled, counts and bitwise checks."""
    data = results["compiled"]
    header = ["model", *(f"{p} ms" for p in _PARENS[:4]), "(c)/(b)", "graphs (b)/(c)"]
    header += ["breaks (c)", "BN updates / step (b), (c)", "(b) ≡ (a)", "(c) ≡ (d)"]

    def bn(count: float) -> str:
        return f"{count:.0f}" if count else "–"

    rows = []
    for r in data["rows"]:
        counts = r["counts"]
        rows.append(
            [r["model"], *(f"{r['median_ms'][c]:.2f}" for c in "abcd"), f"{r['c/b']:.3f}"]
            + [f"{counts['b']['graphs']}/{counts['c']['graphs']}", counts["c"]["breaks"]]
            + [f"{bn(counts['b']['bn_per_step'])}, {bn(counts['c']['bn_per_step'])}"]
            + ["yes" if r[k] else "**no**" for k in ("b == a", "c == d")]
        )
    return _quick_note(data) + table(header, rows)


def selective(results: Results) -> list[str]:
    """selective.json: each configuration's time and memory against full recompute."""
    data = results["selective"]
    header = ["model", "configuration", "ms/step", "time / full", "95 % interval", "kept MiB"]
    header += ["kept / full"]
    header += ["peak heap MiB", "exact"]
    rows = []
    for r in data["rows"]:
        full = r["points"]["full"]
        for config, p in r["points"].items():
            rows.append(
                [
                    r["model"] if config == "none" else "",
                    config,
                    f"{p['ms']:.1f}",
                    f"{p['time_over_full']:.3f}",
                    interval(p["interval"]),
                    f"{p['kept_mib']:.2f}",
                    f"{p['kept_mib'] / full['kept_mib']:.2f}",
                    f"{p['peak_heap_mib']:.2f}",
                    "yes" if p["bitwise_vs_plain"] else "**no**",
                ]
            )
    return _quick_note(data) + table(header, rows, left=2)


def threads(results: Results) -> list[str]:
    """threads.json: the small-op MLP's ratios under each OpenMP setting."""
    header = ["setting", "(c)/(b)", "(d)/(a)", "(b) ms", "(c) − (b) per region, µs"]
    rows = [
        [
            name,
            f"{r['(c)/(b)']:.3f}",
            f"{r['(d)/(a)']:.3f}",
            f"{r['(b) ms']:.1f}",
            f"{r['(c) - (b) per region, us']:.0f}",
        ]
        for name, r in results["threads"].items()
    ]
    return table(header, rows)


def small_models(results: Results) -> list[str]:
    """small_models.json: the region path on small models, paired ratios."""
    data = results["small_models"]
    ratios = ("scopedckpt/torch", "scopedckpt/plain", "torch/plain")
    header = ["model", "blocks", "rounds"]
    header += [h for r in ratios for h in (r, "95 % interval")]
    header += ["ms plain", "torch", "scopedckpt", "saved MiB plain", "torch", "scopedckpt"]
    variants = ("plain", "torch", "scopedckpt")
    rows = [
        [r["model"], r["blocks"], r["rounds"]]
        + [c for k in ratios for c in (f"{r[k]:.3f}", interval(r[f"{k} 95% interval"]))]
        + [f"{r['median_ms'][v]:.2f}" for v in variants]
        + [_mib(r["saved_bytes"][v]) for v in variants]
        for r in data["rows"]
    ]
    models = [f"`{r['model']}`: {r['description']}" for r in data["rows"]]
    facts = f"torch threads: {data['threads']}; intervals: {data['interval']}."
    return _quick_note(data) + table(header, rows) + ["", "; ".join(models) + ".", facts]


def verify(results: Results) -> list[str]:
    """verify.json: step time with bitwise verification of every recompute over without,
    and with the light check over without; peaks of both checks."""
    data = results["verify"]
    header = ["model", "blocks", "rounds", "ms default", "ms bitwise", "bitwise/default"]
    header += ["95 % interval"]
    light = "default/unlit" in data["rows"][0]
    if light:
        header += ["ms unlit", "default/unlit (light check)", "95 % interval"]
        header += ["peak live MiB default", "bitwise", "bitwise/default"]
    header += ["peak heap MiB default", "bitwise"]
    rows = []
    for r in data["rows"]:
        row = [r["model"], r["blocks"], r["rounds"]]
        row += [f"{r['median_ms'][v]:.2f}" for v in ("default", "bitwise")]
        row += [f"{r['bitwise/default']:.3f}", interval(r["bitwise/default 95% interval"])]
        if light:
            live = r["peak_live_mib"]
            row += [f"{r['median_ms']['unlit']:.2f}", f"{r['default/unlit']:.3f}"]
            row += [interval(r["default/unlit 95% interval"])]
            row += [f"{live['default']:.2f}", f"{live['bitwise']:.2f}"]
            row += [f"{live['bitwise'] / live['default']:.3f}"]
        row += [f"{r['peak_heap_mib'][v]:.1f}" for v in ("default", "bitwise")]
        rows.append(row)
    facts = f"torch threads: {data['threads']}; intervals: {data['interval']}."
    return _quick_note(data) + table(header, rows) + ["", facts]


WRITTEN_BY = {
    "compiled": "python -m benchmarks.compiled",
    "fixed_heap": "python -m benchmarks.run --fixed-heap",
    "results": "python -m benchmarks.run",
    "selective": "python -m benchmarks.selective",
    "small_models": "python -m benchmarks.small_models",
    "threads": "python -m benchmarks.threads",
    "verify": "python -m benchmarks.verify",
    "plan": "python -m benchmarks.run --plan",
    "compile_budget": "python -m benchmarks.compile_budget",
    "peak": "python -m benchmarks.peak",
}


def files(results: Results) -> list[str]:
    """Every results file: what writes it, the torch it ran on, whether it was quick."""
    rows = []
    for name in results.names():
        data = results[name]
        torch = data.get("torch", "not recorded")
        quick = {True: "yes", False: "no"}.get(data.get("quick"), "not recorded")
        rows.append([f"`results/{name}.json`", f"`{WRITTEN_BY[name]}`", torch, quick])
    return table(["file", "written by", "torch", "quick run"], rows, left=3)


TABLES: dict[str, Callable[[Results], list[str]]] = {
    "files": files,
    "steps": steps,
    "fixed-heap": fixed_heap,
    "peak-heap": peak_heap,
    "peak-rss": peak_rss,
    "overheads": overheads,
    "dropout": dropout,
    "small-op-gap": _breakdown("small_op_gap (small_mlp, 8 blocks)"),
    "machinery": _breakdown("machinery (small_mlp, 8 blocks)"),
    "checkpoint-cost": _breakdown("checkpoint_cost (small_mlp, 8 blocks)"),
    "forward-hook-cost": _breakdown("forward_hook_cost (small_mlp, 8 blocks)"),
    "region-cost": _breakdown("region_cost (us)"),
    "dropout-floor": _breakdown("dropout_floor (64x64, relative to nn.Dropout)"),
    "dropout-formulations": dropout_formulations,
    "small-models": small_models,
    "verify": verify,
    "compiled": compiled,
    "selective": selective,
    "threads": threads,
}
