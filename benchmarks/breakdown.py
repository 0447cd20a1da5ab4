"""Where the remaining time goes: the breakdown section of ``run.py``'s results.

Run by ``python -m benchmarks.run`` (its "breakdown" section), or alone::

    python -m benchmarks.breakdown [--quick]

Each function times its variants interleaved, in rotating order, in one process
(:mod:`benchmarks.timing`) and returns medians or paired ratios, so machine noise hits
every variant alike.

* :func:`small_op_gap`: the small-op MLP step of torch's checkpoint (b) against
  scopedckpt (c), (c) with the buffer guard's global module hooks switched off by
  hand (not exact for unconverted stateful modules: a measurement only), (e)
  without the RNG replay, and (c)'s converted model checkpointed by torch, which
  splits (c) - (b) into scopedckpt's region machinery and its layers.
* :func:`checkpoint_cost`: what checkpointing itself adds to a small-op MLP step,
  each system on one model switched between its two modes: (b) - (a) on torch's
  layers, (c) - (d) on the converted ones. Unlike the ratios between
  configurations, which compare separate models, it carries no model-to-model
  spread.
* :func:`forward_hook_cost`: the first forward alone (no backward) of the converted
  small-op MLP with and without the guard's global hook, and of the same model
  without regions with and without an empty global hook.
* :func:`benchmarks.machinery.machinery`: scopedckpt's per-region Python on the
  small-op MLP, timed inside real steps and in a tight loop.
* :func:`region_cost`: the fixed cost of one region around a tiny block, in us.
* :func:`benchmarks.dropout.floor` and :func:`benchmarks.dropout.formulations`:
  dropout alone at 64 x 64, and its two formulations by size.
* :func:`recompute_dropout`: the MLP (its dropout the last op of each region,
  131,072 elements) as shipped, with recomputes taking the first forward's
  formulation, and with masks drawn whole: step time against (b) and the peak
  heap in use, each variant on one model.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as tc
from torch import nn

import scopedckpt

from . import dropout, heap, machinery, models
from .internals import GlobalHooksOff, MaskVariant
from .timing import interleaved, interleaved_rounds, paired


def small_op_gap(depth: int, rounds: int) -> dict[str, float]:
    """Step time ratios on the small-op MLP: what the guard's hooks, the RNG replay, the
    regions' machinery and the scoped layers cost."""
    built = {c: models.build("small_mlp", depth, c) for c in ("a", "b", "c", "e")}

    def without_hooks() -> None:
        # The same model as (c): two instances of one model differ by a few
        # percent here (memory placement), more than what is measured.
        with GlobalHooksOff():
            models.step(*built["c"])

    def under_torchs_checkpoint() -> None:
        # (c)'s model, its regions made by torch's checkpoint instead: the same
        # kernels (a recompute draws a dropout seed either way), none of
        # scopedckpt's region machinery. Not exact (new masks in the
        # recompute): a measurement only.
        model, x = built["c"]
        model.mode = "b"
        try:
            models.step(model, x)
        finally:
            model.mode = "c"

    variants: dict[str, Callable[[], object]] = {
        c: (lambda m=built[c]: models.step(*m)) for c in built
    }
    variants["c, global hooks off"] = without_hooks
    variants["c's model, torch's checkpoint"] = under_torchs_checkpoint
    times = interleaved_rounds(variants, calls=1, rounds=rounds)
    b_us = statistics.median(times["b"]) / depth * 1e6  # per region

    def ratio(numerator: str, denominator: str = "b") -> float:
        return paired(times, numerator, denominator)[0]

    def per_region(numerator: str, denominator: str) -> float:
        """us per region, from the paired ratio of each to (b) and (b)'s median."""
        return (ratio(numerator) - ratio(denominator)) * b_us

    off, torchs = "c, global hooks off", "c's model, torch's checkpoint"
    c_b, low, high = paired(times, "c", "b")
    return {
        "(c)/(b)": c_b,
        "(c)/(b) 95% interval low": low,
        "(c)/(b) 95% interval high": high,
        "(c, global hooks off)/(b)": ratio(off),
        "(e)/(b)": ratio("e"),
        "(b) ms": b_us * depth / 1e3,
        "(c) - (b) per region, us": (c_b - 1) * b_us,
        "global hooks per region, us": per_region("c", off),
        "region machinery per region, us": per_region("c", torchs),
        "scoped layers - torch's per region, us": (ratio(torchs) - 1) * b_us,
    }


def checkpoint_cost(depth: int, rounds: int) -> dict[str, float]:
    """Milliseconds checkpointing adds to a small-op MLP step, per system, on one model each."""
    plain = models.build("small_mlp", depth, "b")
    converted = models.build("small_mlp", depth, "c")

    def in_mode(built: tuple[models.Blocks, torch.Tensor], mode: str) -> Callable[[], None]:
        def go() -> None:
            built[0].mode = mode
            models.step(*built)

        return go

    median = interleaved(
        {
            "a": in_mode(plain, "a"),
            "b": in_mode(plain, "b"),
            "d": in_mode(converted, "d"),
            "c": in_mode(converted, "c"),
        },
        calls=1,
        rounds=rounds,
    )
    torch_ms = (median["b"] - median["a"]) * 1e3
    ours_ms = (median["c"] - median["d"]) * 1e3
    return {
        "(b) - (a), ms": torch_ms,
        "(c) - (d), ms": ours_ms,
        "difference per region, us": (ours_ms - torch_ms) / depth * 1e3,
        "(d)/(a) on these two models": median["d"] / median["a"],
        "(c)/(b) on these two models": median["c"] / median["b"],
    }


def forward_hook_cost(depth: int, rounds: int) -> dict[str, float]:
    """Microseconds per forward (no backward) of the converted small-op MLP."""
    model, x = models.build("small_mlp", depth, "c")

    def forward(mode: str) -> Callable[[], None]:
        def go() -> None:
            model.mode = mode
            with scopedckpt.checkpointing(enabled=mode == "c"):
                model(x)

        return go

    def global_hooks_off() -> None:
        with GlobalHooksOff():
            forward("c")()

    def empty_global_hook() -> None:
        handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
        try:
            forward("d")()
        finally:
            handle.remove()

    median = interleaved(
        {
            "(c) forward": forward("c"),
            "(c) forward, global hooks off": global_hooks_off,
            "(d) forward": forward("d"),
            "(d) forward, an empty global hook": empty_global_hook,
        },
        calls=5,
        rounds=rounds,
    )
    return {f"{name}, us": seconds * 1e6 for name, seconds in median.items()}


class _Tiny(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos()


def region_cost(rounds: int) -> dict[str, float]:
    """Forward + backward of one region around ``sin().cos()`` of a 4 x 4 tensor, in us."""
    block = _Tiny()
    x = torch.ones(4, 4, requires_grad=True)

    def plain() -> None:
        with scopedckpt.checkpointing():
            y = block(x)
        y.sum().backward()

    def torch_checkpoint() -> None:
        with scopedckpt.checkpointing():
            y = tc.checkpoint(block, x, use_reentrant=False)
        y.sum().backward()

    def ours() -> None:
        with scopedckpt.checkpointing():
            y = scopedckpt.checkpoint(block, x)
        y.sum().backward()

    median = interleaved(
        {"plain": plain, "torch.utils.checkpoint": torch_checkpoint, "scopedckpt": ours},
        calls=200,
        rounds=rounds,
    )
    return {name: seconds * 1e6 for name, seconds in median.items()}


def recompute_dropout(depth: int, rounds: int) -> dict[str, float]:
    """The MLP's step time relative to (b), and its peak heap in use (MiB), by variant."""
    b = models.build("mlp", depth, "b")
    c = models.build("mlp", depth, "c")
    variants = {
        "(c)": MaskVariant(first_forwards=False, whole=False),
        "(c), recomputes in the first forward's formulation": MaskVariant(True, False),
        "(c), masks drawn whole": MaskVariant(False, True),
        "(c), both (the previous release)": MaskVariant(True, True),
    }

    def timed(variant: MaskVariant) -> Callable[[], None]:
        def step() -> None:
            with variant:
                models.step(*c)

        return step

    median = interleaved(
        {"(b)": lambda: models.step(*b), **{k: timed(v) for k, v in variants.items()}},
        calls=1,
        rounds=rounds,
    )
    result = {f"{k}/(b)": median[k] / median["(b)"] for k in variants}
    result["(b) peak heap, MiB"] = heap.peak_in_use(lambda: models.step(*b)) / 2**20
    for name, variant in variants.items():
        with variant:
            result[f"{name} peak heap, MiB"] = heap.peak_in_use(lambda: models.step(*c)) / 2**20
    return result


def main(rounds: int = 21) -> dict[str, Any]:
    """Every section, printed; returns them as ``results.json``'s ``breakdown``."""
    results: dict[str, Any] = {
        "small_op_gap (small_mlp, 8 blocks)": small_op_gap(8, rounds * 4),
        "machinery (small_mlp, 8 blocks)": machinery.machinery(8, rounds * 5),
        "checkpoint_cost (small_mlp, 8 blocks)": checkpoint_cost(8, rounds * 4),
        "forward_hook_cost (small_mlp, 8 blocks)": forward_hook_cost(8, rounds * 3),
        "region_cost (us)": region_cost(rounds),
        "dropout_floor (64x64, relative to nn.Dropout)": dropout.floor(rounds),
        "recompute_dropout (mlp, 8 blocks)": recompute_dropout(8, rounds * 2),
    }
    for section, values in results.items():
        print(f"\n{section}:")
        for name, value in values.items():
            print(f"  {name:<56}{value:>10.3f}")
    formulations = dropout.formulations(rounds)
    print("\nscoped dropout's two formulations, relative to nn.Dropout:")
    for size, ratios in formulations.items():
        print(f"  {size:<12}" + ", ".join(f"{k}: {v:.2f}" for k, v in ratios.items()))
    return {**results, "dropout_formulations (relative to nn.Dropout)": formulations}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 21")
    torch.set_num_threads(2)
    main(rounds=5 if parser.parse_args().quick else 21)
