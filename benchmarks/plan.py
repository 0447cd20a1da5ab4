"""The memory-budget planner against torch's uniform strategies, side by side in one run.

Run by hand from the repository root (not part of the test suite)::

    python -m benchmarks.run --plan [--quick]
    python -m benchmarks.plan --solver      # the solver's time alone, into results/plan.json
    python -m benchmarks.plan --device=cuda # on a GPU: results/plan_cuda.json and .png

For each model, every strategy is one point (peak bytes of a step, step time):

  * no checkpointing;
  * torch's checkpoint (``use_reentrant=False``) on every k-th block, k = 1..4, plain
    and with torch's selective checkpointing keeping the ``compute`` preset's ops
    (``scopedckpt.policies.save_compute``: matmuls, fused attention, convolutions);
  * ``scopedckpt.checkpointing(plan)`` for plans from the smallest feasible budget to
    the whole peak, and at the peaks torch's every-k strategies measured.

torch's points run the model as shipped; plans run it too for the real models, and for the
benchmark models a converted copy (``scopedckpt.convert``, as the step-time table's (c)
against (b)): same weights, scoped layers.
Peak: the most bytes of storages ops created and had not freed during a step (NOTE
[ live bytes ], the planner's own unit, which is ``torch.cuda.max_memory_allocated``'s
on CUDA), in the second step of each point. Step time: the points stepped in
interleaved rounds (``timing.interleaved_rounds``), ratios paired per round with 95 %
intervals. Planning: ``plan()``'s wall time over the median step without checkpointing, the
median of ``PLANNINGS`` calls but the first (which pays one-time set-up: ``first_planning_s``).
Writes ``results/plan.json`` and ``results/plan.png`` (with matplotlib).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import scopedckpt
from scopedckpt import policies

from . import RESULTS, THREADS, models
from .internals import LiveBytes, choose, profile_step, solve
from .real_imports import UnavailableError, import_timm, import_transformers
from .timing import interleaved_rounds, paired, save_paired_results


@dataclass
class Subject:
    """A model, one step's inputs, its loss and its blocks; ``planned``: the model the
    plans run on, if not ``model`` itself (the benchmark models' converted copy)."""

    model: nn.Module
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    blocks: list[nn.Module]
    planned: nn.Module | None = None


def _square_mean(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def _bench(kind: str, depth: int) -> Subject:
    """torch's points on the model with torch's layers, plans on its converted copy (the
    step-time table's (b) and (c))."""
    model, x = models.build(kind, depth, "a")
    converted, _ = models.build(kind, depth, "d")
    return Subject(model, (x,), _square_mean, list(model.blocks), converted)


def _gpt2() -> Subject:
    transformers = import_transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=512, n_positions=128, n_embd=128, n_layer=8, n_head=4,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False,
        attn_implementation="eager",
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (8, 128))
    return Subject(
        model, (ids,), lambda out: out.logits.float().square().mean(), list(model.transformer.h)
    )


def _bert() -> Subject:
    transformers = import_transformers()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
        intermediate_size=512, max_position_embeddings=128, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.BertModel(config, add_pooling_layer=False)
    ids = torch.randint(0, 512, (8, 128))
    return Subject(
        model, (ids,), lambda out: out.last_hidden_state.square().mean(), list(model.encoder.layer)
    )


def _resnet() -> Subject:
    timm = import_timm()
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10, drop_path_rate=0.1)
    x = torch.randn(16, 3, 64, 64)
    labels = torch.randint(0, 10, (16,))
    blocks = [
        b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer
    ]
    return Subject(model, (x,), lambda y: F.cross_entropy(y, labels.to(y.device)), blocks)


SUBJECTS: dict[str, Callable[[], Subject]] = {
    "mlp (8 blocks)": functools.partial(_bench, "mlp", 8),
    "transformer (8 blocks)": functools.partial(_bench, "transformer", 8),
    "cnn (8 blocks)": functools.partial(_bench, "cnn", 8),
    "HF GPT-2 (8 layers)": _gpt2,
    "HF BERT (8 layers)": _bert,
    "timm ResNet-18 (8 blocks)": _resnet,
}
QUICK = ("transformer (8 blocks)", "cnn (8 blocks)")
FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)  # of the span smallest feasible .. whole peak
PLANNINGS = 4  # plan() calls timed per model: the median of all but the first


def _overloads(packets: tuple[Any, ...]) -> list[Any]:
    return [getattr(p, name) for p in packets for name in p.overloads()]


@contextlib.contextmanager
def torch_every(blocks: list[nn.Module], k: int, sac: bool) -> Iterator[None]:
    """Every k-th block (the last of each k) through torch's checkpoint, with torch's
    selective checkpointing of ``save_compute``'s ops if ``sac``."""
    keywords: dict[str, Any] = {"use_reentrant": False}
    if sac:
        keywords["context_fn"] = functools.partial(
            torch_checkpoint.create_selective_checkpoint_contexts,
            _overloads(policies.save_compute),
        )
    chosen = blocks[k - 1 :: k]
    for block in chosen:
        forward = block.forward
        block.forward = functools.partial(torch_checkpoint.checkpoint, forward, **keywords)
    try:
        yield
    finally:
        for block in chosen:
            del block.forward


def on(subject: Subject, device: torch.device) -> Subject:
    """``subject`` with its models and inputs moved to ``device``."""
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in subject.inputs)
    planned = subject.planned.to(device) if subject.planned is not None else None
    return Subject(subject.model.to(device), inputs, subject.loss_fn, subject.blocks, planned)


def _cuda(model: nn.Module) -> bool:
    return next(model.parameters()).device.type == "cuda"


def _step(model: nn.Module, subject: Subject, scope: Callable[[], Any]) -> None:
    with scope():
        loss = subject.loss_fn(model(*subject.inputs))
    loss.backward()
    models.clear_grads(model)
    if _cuda(model):
        torch.cuda.synchronize()  # so that wall time measures the step


def _peak(model: nn.Module, subject: Subject, scope: Callable[[], Any]) -> int:
    """Bytes a step adds at its peak: LiveBytes on CPU, the allocator's count on CUDA."""
    _step(model, subject, scope)  # first-step transients aside
    if _cuda(model):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, subject, scope)
        return torch.cuda.max_memory_allocated() - before
    with LiveBytes() as counter:
        _step(model, subject, scope)
    return counter.peak


def measure(name: str, subject: Subject, rounds: int) -> dict[str, Any]:
    """Every point of one model: peaks, plans, step times in interleaved rounds."""
    model, blocks = subject.model, subject.blocks
    planned = subject.planned or model
    model.train()
    planned.train()
    named = {id(m): n for n, m in model.named_modules()}
    candidates = [(named[id(b)], planned.get_submodule(named[id(b)])) for b in blocks]
    _step(planned, subject, contextlib.nullcontext)  # warm-up
    plannings = []
    for _ in range(PLANNINGS):  # the first pays one-time set-up (imports, caches)
        began = time.perf_counter()
        first = scopedckpt.plan(
            planned,
            *subject.inputs,
            budget=1.0,
            blocks=[module for _, module in candidates],
            loss_fn=subject.loss_fn,
        )
        plannings.append(time.perf_counter() - began)
    planning = statistics.median(plannings[1:])
    profile = profile_step(planned, candidates, subject.inputs, {}, subject.loss_fn)
    scopes: dict[str, Callable[[], Any]] = {"no checkpointing": contextlib.nullcontext}
    runs: dict[str, nn.Module] = {"no checkpointing": model}
    for k in (1, 2, 3, 4):
        for sac in (False, True):
            label = f"torch every {k}" + (" + SAC compute" if sac else "")
            scopes[label] = functools.partial(torch_every, blocks, k, sac)
            runs[label] = model
    peaks = {label: _peak(model, subject, scope) for label, scope in scopes.items()}
    low, high = first.smallest_budget, first.no_checkpoint_peak
    budgets = {f"plan {f:.0%}": math.ceil(low + f * (high - low)) for f in FRACTIONS}
    for k in (1, 2, 3, 4):
        budgets[f"plan at torch every {k}"] = peaks[f"torch every {k}"]
    plans: dict[str, Any] = {}
    for label, budget in budgets.items():
        if budget < low:
            continue
        plans[label] = choose(profile, budget, planned)
        scopes[label] = functools.partial(scopedckpt.checkpointing, plans[label])
        runs[label] = planned
        peaks[label] = _peak(planned, subject, scopes[label])
    times = interleaved_rounds(
        {
            label: functools.partial(_step, runs[label], subject, scope)
            for label, scope in scopes.items()
        },
        calls=1,
        rounds=rounds,
    )
    plain = statistics.median(times["no checkpointing"])
    points = []
    for label in scopes:
        ratio, lo, hi = paired(times, label, "no checkpointing")
        point: dict[str, Any] = {
            "label": label,
            "kind": "plan"
            if label in plans
            else ("none" if label == "no checkpointing" else "torch"),
            "peak_bytes": peaks[label],
            "step_s": statistics.median(times[label]),
            "ratio": ratio,
            "interval": [lo, hi],
        }
        if label in plans:
            p = plans[label]
            point.update(
                budget=p.budget,
                predicted_peak=p.peak,
                predicted_ratio=p.overhead,
                choices=[b.choice for b in p.blocks],
            )
        points.append(point)
    against = {}
    for k in (1, 2):
        mine = f"plan at torch every {k}"
        if mine in plans:
            against[f"every {k}"] = list(paired(times, mine, f"torch every {k}"))
    return {
        "model": name,
        "blocks": len(blocks),
        "plain_step_s": plain,
        "planning_s": planning,
        "planning_steps": planning / plain,
        "first_planning_s": plannings[0],
        "smallest_budget": low,
        "no_checkpoint_peak": high,
        "points": points,
        "plan_vs_torch": against,
        "dominated": dominated(points),
        "worst_peak_error": max(
            abs(p["peak_bytes"] - p["predicted_peak"]) / p["predicted_peak"]
            for p in points
            if p["kind"] == "plan"
        ),
    }


def solver_seconds(blocks: int = 200, repeats: int = 5) -> dict[str, float]:
    """Seconds the solver takes for ``blocks`` blocks of three choices (the transformer's
    profile, its blocks repeated), at three budgets across the feasible span; medians."""
    subject = _bench("transformer", 4)
    model = subject.planned or subject.model
    named = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    profile = profile_step(model, named, subject.inputs, {}, subject.loss_fn)
    options = [profile.blocks[i % 4].choices[:3] for i in range(blocks)]
    floors = [profile.floors[min(i, 4)] for i in range(blocks + 1)]
    low = solve(floors, options, float("inf"), minimize="peak")
    assert low is not None
    high = sum(o[0].kept for o in options) + max(f or 0 for f in floors)
    out = {}
    for fraction in (0.1, 0.5, 0.9):
        budget = low.peak + fraction * (high - low.peak)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            solve(floors, options, budget)
            times.append(time.perf_counter() - began)
        out[f"{fraction:.0%}"] = statistics.median(times)
    return out


def dominated(points: list[dict[str, Any]]) -> list[list[str]]:
    """(torch point, plan) pairs where torch's is both smaller and faster (medians)."""
    pairs = []
    for t in points:
        if t["kind"] != "torch":
            continue
        for p in points:
            if (
                p["kind"] == "plan"
                and t["peak_bytes"] < p["peak_bytes"]
                and t["step_s"] < p["step_s"]
            ):
                pairs.append([t["label"], p["label"]])
    return pairs


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """``path`` (results/plan.png): each model's points, plans as a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3
    lines = math.ceil(len(rows) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5 * columns, 4 * lines), squeeze=False)
    for ax, row in zip(axes.flat, rows):
        plans = sorted(
            (p for p in row["points"] if p["kind"] == "plan"), key=lambda p: p["peak_bytes"]
        )
        ax.plot(
            [p["peak_bytes"] / 2**20 for p in plans],
            [p["ratio"] for p in plans],
            "o-",
            label="scopedckpt plans",
        )
        for p in row["points"]:
            if p["kind"] == "plan":
                continue
            marker = "s" if p["kind"] == "none" else ("^" if "SAC" in p["label"] else "x")
            ax.plot(p["peak_bytes"] / 2**20, p["ratio"], marker, label=p["label"])
        ax.set_title(row["model"], fontsize=10)
        ax.set_xlabel("peak of a step (MiB)")
        ax.set_ylabel("step time / no checkpointing")
    axes.flat[0].legend(fontsize=6)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(quick: bool, solver_only: bool = False, device: str = "cpu", out: Path = RESULTS) -> None:
    """Measure every subject (``--quick``: two, fewer rounds) and write the results;
    ``solver_only``: measure the solver alone into the existing results; on a CUDA
    ``device`` peaks are ``max_memory_allocated``'s and the files ``plan_cuda.*`` in
    ``out`` (tests/gpu/check_cuda.py runs it there)."""
    torch.set_num_threads(THREADS)
    where = torch.device(device)
    stem = "plan" if where.type == "cpu" else f"plan_{where.type}"
    if solver_only:
        path = RESULTS / "plan.json"
        results = json.loads(path.read_text())
        results["solver_200_blocks_s"] = solver_seconds()
        path.write_text(json.dumps(results, indent=2) + "\n")
        return
    rounds = 5 if quick else 15
    rows, skipped = [], {}
    for name, build in SUBJECTS.items():
        if quick and name not in QUICK:
            continue
        try:
            subject = on(build(), where)
        except UnavailableError as error:
            skipped[name] = str(error)
            continue
        rows.append(measure(name, subject, rounds))
        row = rows[-1]
        print(
            f"{name}: planning {row['planning_steps']:.2f} steps, worst peak error "
            f"{row['worst_peak_error']:.1%}, vs torch {row['plan_vs_torch']}, "
            f"dominated {row['dominated']}",
            flush=True,
        )
    extra = {
        "solver_200_blocks_s": solver_seconds(),
        "device": str(where),
        "skipped": skipped,
        "rounds": rounds,
    }
    save_paired_results(stem, rows, THREADS, quick, extra, out)
    try:
        plot(rows, out / f"{stem}.png")
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    import sys

    device = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--device=")), "cpu")
    main("--quick" in sys.argv, solver_only="--solver" in sys.argv, device=device)
