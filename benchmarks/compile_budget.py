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
gradients and buffers compared bit for bit, with the largest difference relative to the
reference tensor's largest magnitude where they differ, under
``torch.use_deterministic_algorithms(True)``, as bitwise training needs: without it
inductor lowers an embedding's backward (``index_put`` accumulating) to atomic adds on
CPU, and the compiled model without regions does not reproduce its own gradients (each
reference is run twice to show that it does under it: ``reproducible``;
``nondeterministic``: the difference between two runs of the model as shipped, compiled
without regions, without it). Peaks and times are of the default, deterministic
algorithms off (they fill new memory, and change a few lowerings): each point compiles
once for each.

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
from torch._inductor.compile_fx import compile_fx

import scopedckpt

from . import THREADS
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


def _inductor_at(budget: float) -> Callable[..., Any]:
    """Inductor with AOT autograd's activation memory budget set to ``budget``: a backend
    of its own per budget, since dynamo reuses a graph compiled for another copy of the
    same model when the backend is the same (its guards are on the module's code and
    tensors' shapes, not on the module object or the budget)."""

    def backend(graph: Any, example_inputs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_fx(graph, example_inputs)

    return backend


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


def _difference(state: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """0 where ``state`` is ``reference`` bit for bit, else the largest difference of two
    tensors relative to the reference tensor's largest magnitude (inf: other shapes)."""
    if len(state) != len(reference):
        return math.inf
    worst = 0.0
    for x, y in zip(state, reference):
        if x.shape != y.shape or x.dtype != y.dtype:
            return math.inf
        if not torch.equal(x, y):
            scale = float(y.abs().max()) if y.is_floating_point() else 1.0
            gap = float((x.double() - y.double()).abs().max())
            worst = max(worst, gap / scale if scale else math.inf)
    return worst


@contextmanager
def _deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` inside the block."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _exact_state(run: Callable[..., Any], model: nn.Module, subject: Subject, scope: Any) -> list:
    """:func:`_state` under deterministic algorithms; then a step without them, so that
    the default graph is compiled before peaks and times are measured."""
    with _deterministic():
        state = _state(run, model, subject, scope)
    _step(run, model, subject, scope)
    return state


def _reproduces(
    run: Callable[..., Any], model: nn.Module, subject: Subject, reference: list
) -> bool:
    """Whether a second run under deterministic algorithms gives ``reference`` bit for bit."""
    with _deterministic():
        return _difference(_state(run, model, subject, nullcontext), reference) == 0.0


def _nondeterministic_gap(shipped: nn.Module, subject: Subject) -> float:
    """The difference between two runs of ``shipped`` compiled without regions, without
    deterministic algorithms: 0 where compiled training reproduces itself anyway."""
    model = copy.deepcopy(shipped)
    run = torch.compile(model)
    first = _state(run, model, subject, nullcontext)
    return _difference(_state(run, model, subject, nullcontext), first)


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
    nondeterministic = _nondeterministic_gap(shipped, subject)
    steps: dict[str, Callable[[], None]] = {}
    difference: dict[str, float] = {}  # from the reference: 0 where bitwise
    reproducible: dict[str, bool] = {}  # each reference, run twice
    kinds: dict[str, str] = {}
    plans: dict[str, Any] = {}
    torch._dynamo.reset()
    for budget in budgets:
        label = f"budget {budget:g}"
        model = copy.deepcopy(shipped)
        run = torch.compile(model, backend=_inductor_at(budget))
        state = _exact_state(run, model, subject, nullcontext)  # compiles here
        steps[label] = functools.partial(_step, run, model, subject, nullcontext)
        kinds[label] = "budget"
        if budget == 1.0:
            reference = state
            reproducible["compiled as shipped"] = _reproduces(run, model, subject, reference)
        difference[label] = _difference(state, reference)
    # One compiled converted model for every plan: the plan in scope is part of what
    # dynamo guards on, so each plan gets its own graph.
    run = torch.compile(converted)
    compiled_reference = _exact_state(run, converted, subject, nullcontext)
    eager_reference = _exact_state(converted, converted, subject, nullcontext)
    for family, runner, reference in (
        ("compiled converted", run, compiled_reference),
        ("eager converted", converted, eager_reference),
    ):
        reproducible[family] = _reproduces(runner, converted, subject, reference)
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
            state = _exact_state(runner, converted, subject, scope)
            difference[label] = _difference(state, reference)
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
            "exact": difference[label] == 0.0,
            "difference": difference[label],
        }
        if label in plans:
            point["plan_budget"] = plans[label].budget
            point["choices"] = [b.choice for b in plans[label].blocks]
        points.append(point)
    return {
        "model": name,
        "rounds": rounds,
        "reproducible": reproducible,
        "nondeterministic": nondeterministic,
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
        print(f"\n{row['model']}: peak MiB (heap), step / compiled step, difference")
        print(f"  references reproduce themselves: {row['reproducible']}")
        print(f"  without deterministic algorithms: {row['nondeterministic']:.1e}")
        for p in row["points"]:
            low, high = p["interval"]
            print(
                f"  {p['label']:<22}{p['peak_bytes'] / 2**20:>9.2f}"
                f"{p['ratio']:>8.3f} ({low:.3f}-{high:.3f})  {p['difference']:.1e}"
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
