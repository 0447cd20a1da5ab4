"""The selective-saving section of the benchmark: memory against time for each save policy.

Run as ``python -m benchmarks.selective [--quick]`` (or ``python -m benchmarks.run
--selective``); writes ``benchmarks/results/selective.json`` and ``selective.png``
(``--replot`` redraws the plot from the JSON alone).

For each model (converted, one region per block), the memory/time trade-off of:
  none             scoped layers, no checkpointing
  full             scopedckpt regions, everything recomputed
  mode only        scopedckpt regions with a policy that keeps nothing (an op the model
                   never calls): what the dispatch mode of selective saving costs by itself
  <preset>         scopedckpt regions with ``save=scopedckpt.policies.<preset>``
  torch SAC        torch.utils.checkpoint with torch's selective checkpointing on the
                   ops of ``save_compute`` (torch's own layers: the reference scopedckpt's
                   exactness is measured against; not exact with batch norm)
Each point: median step time and, paired per round with full recompute's, its ratio to it
with a 95 % interval (interleaved rounds in one process); the heap bytes in
use after the forward above those before it (mallinfo2: what the forward keeps for
backward, the plot's y axis); the peak heap bytes in use during the step
(``heap.peak_in_use``, after every aten op; parameter gradients often set it); and
whether the gradients and buffers after two steps equal, bitwise, two steps of the
same layers without checkpointing.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tc
from torch import nn

import scopedckpt
from scopedckpt import policies

from . import RESULTS, THREADS, heap, models
from .timing import interleaved_rounds, paired, save_paired_results

PRESETS = ("save_matmuls", "save_attention", "save_convolutions", "save_compute")


def _ops(policy: tuple[Any, ...]) -> list[Any]:
    """torch's SAC takes overloads, not packets."""
    return [getattr(p, name) for p in policy for name in p.overloads()]


def configurations(model_ops: set[str]) -> dict[str, Any]:
    """The configurations worth measuring for a model (presets that select its ops)."""
    # "mode only": an op policy naming an op the model never calls. It keeps nothing,
    # so (mode only)/(full) is the cost of the dispatch mode itself.
    configs: dict[str, Any] = {"none": "none", "full": None, "mode only": [torch.ops.aten.cholesky]}
    for name in PRESETS:
        preset = getattr(policies, name)
        if any(p.__name__ in model_ops for p in preset):
            configs[name] = preset
    configs["torch SAC"] = "torch"
    return configs


def _forward(model: nn.Module, x: torch.Tensor, how: Any) -> torch.Tensor:
    blocks = model.blocks  # type: ignore[attr-defined]
    if how == "torch":
        context = functools.partial(
            tc.create_selective_checkpoint_contexts, _ops(policies.save_compute)
        )
        h = model.stem(x)  # type: ignore[attr-defined]
        for block in blocks:
            h = tc.checkpoint(block, h, use_reentrant=False, context_fn=context)
        return model.head(h).square().mean()  # type: ignore[attr-defined]
    with scopedckpt.checkpointing(
        blocks, enabled=how != "none", save=None if how == "none" else how
    ):
        return model(x).square().mean()


def _backward(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    """Backward, then clear the gradients; returns them."""
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


def _step(model: nn.Module, x: torch.Tensor, how: Any) -> list[torch.Tensor]:
    return _backward(model, _forward(model, x, how))


def _kept_by_forward(model: nn.Module, x: torch.Tensor, how: Any) -> int:
    """Heap bytes in use after the forward, above those before it: what the forward
    leaves alive for backward (activations, masks, kept outputs, tapes)."""
    before = heap.in_use()
    loss = _forward(model, x, how)
    kept = heap.in_use() - before
    _backward(model, loss)
    return kept


def _model_ops(model: nn.Module, x: torch.Tensor) -> set[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Spy():
        model(x)
    return seen


def _exact(build: Callable[[], tuple[nn.Module, torch.Tensor]], how: Any) -> bool:
    """Two steps of this configuration against two steps without checkpointing of the
    same layers (torch's for torch SAC, scoped ones otherwise), bitwise."""
    results = []
    for config in ("none", how):
        torch.manual_seed(0)
        model, x = build()
        if how != "torch":
            model = scopedckpt.convert(model)
        model.mode = "a"  # type: ignore[assignment]
        produced: list[torch.Tensor] = []
        torch.manual_seed(1)
        for _ in range(2):
            produced += [g.clone() for g in _step(model, x, config) if g is not None]
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.99)
        produced += [b.clone() for b in model.buffers()]
        results.append(produced)
    return all(torch.equal(a, b) for a, b in zip(*results))


def measure(
    name: str, build: Callable[[], tuple[nn.Module, torch.Tensor]], repeats: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    model, x = build()
    model.mode = "a"  # type: ignore[assignment]
    ops = _model_ops(model, x)
    configs = configurations(ops)
    built = {}
    for config, how in configs.items():
        torch.manual_seed(0)
        m, _ = build()
        m.mode = "a"  # type: ignore[assignment]
        built[config] = m if how == "torch" else scopedckpt.convert(m)
    times = interleaved_rounds(
        {c: functools.partial(_step, built[c], x, how) for c, how in configs.items()},
        calls=1,
        rounds=repeats,
    )
    points = {}
    for config, how in configs.items():
        peak = heap.peak_in_use(lambda m=built[config], h=how: _step(m, x, h))
        ratio, low, high = paired(times, config, "full")
        points[config] = {
            "ms": statistics.median(times[config]) * 1e3,
            "time_over_full": ratio,
            "interval": [low, high],
            "kept_mib": _kept_by_forward(built[config], x, how) / 2**20,
            "peak_heap_mib": peak / 2**20,
            "bitwise_vs_plain": _exact(build, how) if how != "none" else True,
        }
    return {"model": name, "points": points}


def run(
    factories: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]], repeats: int
) -> list[Any]:
    """Measure every model, print the table, return its rows."""
    rows = []
    for name, build in factories.items():
        rows.append(measure(name, build, repeats))
    print(
        f"\n{'model':<16}{'configuration':<19}{'ms/step':>9}{'time/full':>10}"
        f"{'kept MiB':>10}{'kept/full':>10}{'peak MiB':>10}{'exact':>7}"
    )
    for row in rows:
        full = row["points"]["full"]
        for config, point in row["points"].items():
            print(
                f"{row['model']:<16}{config:<19}{point['ms']:>9.2f}"
                f"{point['time_over_full']:>10.3f}{point['kept_mib']:>10.2f}"
                f"{point['kept_mib'] / full['kept_mib']:>10.2f}{point['peak_heap_mib']:>10.2f}"
                f"{'yes' if point['bitwise_vs_plain'] else 'NO':>7}"
            )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Heap kept by the forward against step time, a panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(c for row in rows for c in row["points"]))
    colors = {c: f"C{i}" for i, c in enumerate(configs)}
    fig, axes = plt.subplots(2, (len(rows) + 1) // 2, figsize=(11, 8))
    for ax, row in zip(axes.flat, rows):
        for config, point in row["points"].items():
            ax.plot(
                point["ms"],
                point["kept_mib"],
                "x" if config == "torch SAC" else "o",
                color=colors[config],
                markersize=8,
                label=config,
            )
        ax.set_title(row["model"])
        ax.set_xlabel("step time (ms, median)")
        ax.set_ylabel("heap kept by the forward (MiB)")
    handles = {
        label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())
    }
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)


def main(quick: bool) -> None:
    """Every model's trade-off; writes ``results/selective.json`` and the plot."""
    depth = 4 if quick else 8
    factories = {
        f"mlp x{depth}": lambda: models.mlp(depth),
        f"transformer x{depth}": lambda: models.transformer(depth),
        f"cnn x{depth}": lambda: models.cnn(depth),
        "wide_mlp x4": lambda: models.wide_mlp(4),
    }
    rounds = 5 if quick else 15
    rows = run(factories, repeats=rounds)
    save_paired_results("selective", rows, THREADS, quick, {"rounds": rounds})
    plot(rows, RESULTS / "selective.png")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 blocks, 5 rounds")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot")
    args = parser.parse_args()
    if args.replot:
        plot(
            json.loads((RESULTS / "selective.json").read_text())["rows"], RESULTS / "selective.png"
        )
    else:
        torch.set_num_threads(THREADS)
        main(args.quick)
