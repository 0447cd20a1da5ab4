"""Plans beside torch.compile's activation memory budget, at measured peaks, in one run.

Run by hand from the repository root (not part of the test suite)::

    python -m benchmarks.compile_budget [--quick]
    python -m benchmarks.run --plan [--quick]   # the planner's section, then this one

torch's only memory-budget tool is compile-only: ``torch._functorch.config.
activation_memory_budget`` (0 to 1) makes AOT autograd's partitioner choose, op by op,
what the compiled backward recomputes (torchtitan's ``memory_budget`` mode). For each
model, every point is one compiled (inductor, CPU) or eager configuration:

  * **budget b**: the model as shipped, compiled with ``activation_memory_budget = b``
    (1.0 is compile's default: no recompute);
  * **compiled plan f**: ``scopedckpt.plan`` at the fraction f of its span (smallest
    feasible budget .. no-checkpointing peak), ``checkpointing(plan)`` entered around
    the compiled model: its regions become torch's checkpoint operator (NOTE [
    torch.compile ] in ``scopedckpt/core/_compiled.py``); the plan runs on a converted
    copy (``scopedckpt.convert``), as in ``benchmarks.plan``;
  * **eager plan f**: the same plan, not compiled (what compiling buys).

Peak: heap bytes in use (glibc's ``mallinfo2``, :mod:`benchmarks.heap`) above those before
the step, sampled by a thread that reads it in a loop while the step runs: compiled code
runs no dispatch mode, so neither the planner's counter nor the per-op sampler sees inside
it. The median of three steps. Step time: every point in interleaved rounds
(:mod:`benchmarks.timing`), ratios paired per round with 95 % intervals. Exactness: three
steps of each point against the same family's reference (budget 1.0 for budget points;
the converted model compiled without regions for compiled plans, eager for eager plans),
gradients and buffers compared bit for bit.

Writes ``results/compile_budget.json``; docs/benchmarks.md's section is generated from it.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import statistics
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

import scopedckpt

from . import THREADS
from .compiled import _equal
from .heap import in_use
from .models import clear_grads
from .plan import Subject, _bench, _gpt2
from .real_imports import UnavailableError
from .timing import interleaved_rounds, paired, save_paired_results

SUBJECTS: dict[str, Callable[[], Subject]] = {
    "transformer (8 blocks)": functools.partial(_bench, "transformer", 8),
    "HF GPT-2 (8 layers)": _gpt2,
}
BUDGETS = (1.0, 0.7, 0.5, 0.3, 0.1, 0.0)
FRACTIONS = (0.0, 0.25, 0.5, 0.75)
QUICK_BUDGETS = (1.0, 0.5, 0.0)
QUICK_FRACTIONS = (0.0, 0.5)


class _HeapSampler:
    """The most heap bytes in use while the block runs, read in a loop by a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._running = False

    def _loop(self) -> None:
        while self._running:
            used = in_use()
            if used > self.peak:
                self.peak = used

    def __enter__(self) -> _HeapSampler:
        self.before = in_use()
        self.peak = self.before
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # the sampler gets the interpreter between ops
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()
        sys.setswitchinterval(self._interval)
        self.peak = max(self.peak, in_use()) - self.before


@contextmanager
def _memory_budget(budget: float) -> Iterator[None]:
    """AOT autograd's activation memory budget set to ``budget`` while compiling."""
    config = torch._functorch.config
    before = config.activation_memory_budget
    config.activation_memory_budget = budget
    try:
        yield
    finally:
        config.activation_memory_budget = before


def _step(run: Callable[..., Any], model: nn.Module, subject: Subject, scope: Any) -> None:
    with scope():
        loss = subject.loss_fn(run(*subject.inputs))
    loss.backward()
    clear_grads(model)


def _state(run: Callable[..., Any], model: nn.Module, subject: Subject, scope: Any) -> list:
    """Gradients and buffers after each of three steps, each from its own seed, from the
    model's state as it was before (its buffers put back after)."""
    before = copy.deepcopy(model.state_dict())
    seen: list[torch.Tensor] = []
    for seed in range(3):
        torch.manual_seed(seed)
        with scope():
            loss = subject.loss_fn(run(*subject.inputs))
        loss.backward()
        seen += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        seen += [b.clone() for b in model.buffers()]
        clear_grads(model)
    model.load_state_dict(before)
    return seen


def _peak(step: Callable[[], None]) -> int:
    peaks = []
    for _ in range(3):
        with _HeapSampler() as sampler:
            step()
        peaks.append(sampler.peak)
    return int(statistics.median(peaks))


def measure(name: str, subject: Subject, budgets: tuple, fractions: tuple, rounds: int) -> dict:
    """Every point of one model: peaks, exactness, step times in interleaved rounds."""
    shipped, converted = subject.model, subject.planned or subject.model
    shipped.train()
    converted.train()
    named = {id(m): n for n, m in shipped.named_modules()}
    reference: list[torch.Tensor] = []
    blocks = [converted.get_submodule(named[id(b)]) for b in subject.blocks]
    first = scopedckpt.plan(
        converted, *subject.inputs, budget=1.0, blocks=blocks, loss_fn=subject.loss_fn
    )
    low, high = first.smallest_budget, first.no_checkpoint_peak
    steps: dict[str, Callable[[], None]] = {}
    exact: dict[str, bool] = {}
    kinds: dict[str, str] = {}
    plans: dict[str, Any] = {}
    torch._dynamo.reset()
    for budget in budgets:  # one copy each: dynamo guards on the module, not the config
        label = f"budget {budget:g}"
        model = copy.deepcopy(shipped)
        with _memory_budget(budget):
            run = torch.compile(model)
            state = _state(run, model, subject, nullcontext)  # compiles here
        steps[label] = functools.partial(_step, run, model, subject, nullcontext)
        kinds[label] = "budget"
        exact[label] = _equal(state, reference) if budget != 1.0 else True
        if budget == 1.0:
            reference = state
    # One compiled converted model for every plan: the plan in scope is part of what
    # dynamo guards on, so each plan gets its own graph.
    run = torch.compile(converted)
    compiled_reference = _state(run, converted, subject, nullcontext)
    eager_reference = _state(converted, converted, subject, nullcontext)
    for fraction in fractions:
        budget = math.ceil(low + fraction * (high - low))
        plan = scopedckpt.plan(
            converted, *subject.inputs, budget=budget, blocks=blocks, loss_fn=subject.loss_fn
        )
        scope = functools.partial(scopedckpt.checkpointing, plan)
        for kind, runner, reference in (
            ("compiled plan", run, compiled_reference),
            ("eager plan", converted, eager_reference),
        ):
            label = f"{kind} {fraction:.0%}"
            exact[label] = _equal(_state(runner, converted, subject, scope), reference)
            steps[label] = functools.partial(_step, runner, converted, subject, scope)
            kinds[label] = kind
            plans[label] = plan
    peaks = {label: _peak(step) for label, step in steps.items()}
    times = interleaved_rounds(steps, calls=1, rounds=rounds)
    points = []
    for label in steps:
        ratio, lo, hi = paired(times, label, "budget 1")
        point = {
            "label": label,
            "kind": kinds[label],
            "peak_bytes": peaks[label],
            "step_s": statistics.median(times[label]),
            "ratio": ratio,
            "interval": [lo, hi],
            "exact": exact[label],
        }
        if label in plans:
            point["plan_budget"] = plans[label].budget
            point["choices"] = [b.choice for b in plans[label].blocks]
        points.append(point)
    return {
        "model": name,
        "rounds": rounds,
        "points": points,
        "against": _against(points, times),
    }


def _against(points: list[dict], times: dict[str, list[float]]) -> list[dict]:
    """For each budget point, the fastest plan of each kind at an equal or lower peak,
    with the paired ratio of their step times."""
    rows = []
    for budget in (p for p in points if p["kind"] == "budget"):
        row: dict[str, Any] = {"budget": budget["label"], "peak_bytes": budget["peak_bytes"]}
        for kind in ("compiled plan", "eager plan"):
            fitting = [
                p for p in points if p["kind"] == kind and p["peak_bytes"] <= budget["peak_bytes"]
            ]
            if not fitting:
                row[kind] = None
                continue
            best = min(fitting, key=lambda p: p["step_s"])
            ratio, lo, hi = paired(times, best["label"], budget["label"])
            row[kind] = {"label": best["label"], "ratio": ratio, "interval": [lo, hi]}
        rows.append(row)
    return rows


def main(quick: bool) -> None:
    """Every model's points; writes ``results/compile_budget.json`` and prints a table."""
    torch._dynamo.config.cache_size_limit = 64  # a compiled copy per point
    # Every point compiles anew: a cached graph compiled at another budget is not reused.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    rows = []
    for name, build in SUBJECTS.items():
        if quick and name != "transformer (8 blocks)":
            continue
        try:
            subject = build()
        except UnavailableError as error:
            print(f"skipped {name}: {error}", file=sys.stderr)
            continue
        rows.append(
            measure(
                name,
                subject,
                QUICK_BUDGETS if quick else BUDGETS,
                QUICK_FRACTIONS if quick else FRACTIONS,
                rounds=5 if quick else 15,
            )
        )
        print_rows(rows[-1:])
    save_paired_results("compile_budget", rows, THREADS, quick)


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        print(f"\n{row['model']}: peak MiB (heap), step / compiled step, exact")
        for p in row["points"]:
            low, high = p["interval"]
            print(
                f"  {p['label']:<22}{p['peak_bytes'] / 2**20:>9.2f}"
                f"{p['ratio']:>8.3f} ({low:.3f}-{high:.3f})  {p['exact']}"
            )
        for a in row["against"]:
            cells = []
            for kind in ("compiled plan", "eager plan"):
                best = a[kind]
                cells.append(
                    f"{kind}: none fits"
                    if best is None
                    else f"{kind}: {best['label']} {best['ratio']:.3f}"
                    f" ({best['interval'][0]:.3f}-{best['interval'][1]:.3f})"
                )
            print(f"  at {a['budget']}'s peak: " + "; ".join(cells))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the transformer, 3 + 2 points")
    torch.set_num_threads(THREADS)
    main(parser.parse_args().quick)
