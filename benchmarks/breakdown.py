"""Where the remaining time goes: the measurements behind docs/benchmarks.md's profile.

Run by ``python benchmarks/run.py`` (its "breakdown" section), or alone::

    python benchmarks/breakdown.py

Each function times its variants interleaved, in rotating order, in one process
and returns medians or paired ratios (:func:`paired`), so machine noise hits every
variant alike.

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
* ``machinery.machinery`` (benchmarks/machinery.py): scopedckpt's per-region Python
  on the small-op MLP, timed inside real steps and in a tight loop.
* :func:`region_cost`: the fixed cost of one region around a tiny block, in us.
* :func:`dropout_floor`: a 64 x 64 dropout's forward + backward against
  ``nn.Dropout``: the scoped layer, the plain ATen formulations it is built from
  (with no scopedckpt bookkeeping at all), and the kernels that draw the mask.
* :func:`dropout_formulations`: the scoped layer's two formulations (NOTE
  [ two formulations ] in ``scopedckpt/_mask.py``) against ``nn.Dropout`` by
  size: what ``NATIVE_BELOW_ELEMENTS`` was chosen from.
* :func:`recompute_dropout`: the MLP (its dropout the last op of each region,
  131,072 elements) as shipped, with recomputes taking the first forward's
  formulation, and with masks drawn whole: step time against (b) and the peak
  heap in use, each variant on one model.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tc
from torch import nn

import scopedckpt
from scopedckpt import _guard, _mask
from scopedckpt import functional as _functional

sys.path.insert(0, str(Path(__file__).resolve().parent))


def interleaved_rounds(
    variants: dict[str, Callable[[], object]], calls: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant in every round, after a warm-up, timed in rotating order.

    Rotating, so that no variant always follows the same one (a step after a big
    one meets a different allocator and cache state).
    """
    names = list(variants)
    for name in names:  # warm-up
        for _ in range(max(1, calls // 4)):
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(calls):
                variants[name]()
            times[name].append((time.perf_counter() - start) / calls)
    return times


def interleaved(
    variants: dict[str, Callable[[], object]], calls: int, rounds: int
) -> dict[str, float]:
    """Median seconds per call of each variant (:func:`interleaved_rounds`)."""
    times = interleaved_rounds(variants, calls, rounds)
    return {name: statistics.median(values) for name, values in times.items()}


def paired(
    times: dict[str, list[float]], numerator: str, denominator: str
) -> tuple[float, float, float]:
    """The median over rounds of ``numerator / denominator`` within each round, and its
    95 % confidence interval.

    Paired, because the machine's speed drifts from round to round by more than the
    few percent between configurations, and both of a round's times see the same
    drift. The interval is distribution-free: order statistics of the sorted ratios
    whose ranks a Binomial(n, 1/2) puts at most 2.5 % below and above the median
    (for 15 rounds the 4th and 12th of 15, for 120 the 49th and 72nd).
    """
    ratios = sorted(a / b for a, b in zip(times[numerator], times[denominator]))
    n = len(ratios)
    # The lower end is the (k+1)-th ratio for the largest k with P(X <= k) <= 2.5 %.
    below, cumulative = 0, 0.0
    for k in range(n):
        cumulative += math.comb(n, k) / 2**n
        if cumulative > 0.025:
            below = max(k - 1, 0)
            break
    return statistics.median(ratios), ratios[below], ratios[n - 1 - below]


class _GlobalHooksOff:
    """Switch the buffer guard's global module hooks off (a measurement, not exact)."""

    def __enter__(self) -> None:
        self._install, self._uninstall = _guard._install, _guard._uninstall
        _guard._install = _guard._uninstall = lambda *args: None  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        _guard._install, _guard._uninstall = self._install, self._uninstall


def small_op_gap(depth: int, rounds: int) -> dict[str, float]:
    """Step time ratios on the small-op MLP: what the guard's hooks, the RNG replay, the
    regions' machinery and the scoped layers cost."""
    import run

    models = {c: run.build("small_mlp", depth, c) for c in ("a", "b", "c", "e")}

    def without_hooks() -> None:
        # The same model as (c): two instances of one model differ by a few
        # percent here (memory placement), more than what is measured.
        with _GlobalHooksOff():
            run.step(*models["c"])

    def under_torchs_checkpoint() -> None:
        # (c)'s model, its regions made by torch's checkpoint instead: the same
        # kernels (a recompute draws a dropout seed either way), none of
        # scopedckpt's region machinery. Not exact (new masks in the
        # recompute): a measurement only.
        model, x = models["c"]
        model.mode = "b"
        try:
            run.step(model, x)
        finally:
            model.mode = "c"

    variants: dict[str, Callable[[], object]] = {
        c: (lambda m=models[c]: run.step(*m)) for c in models
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
    import run

    plain, converted = run.build("small_mlp", depth, "b"), run.build("small_mlp", depth, "c")

    def in_mode(built: tuple[nn.Module, torch.Tensor], mode: str) -> Callable[[], None]:
        def go() -> None:
            built[0].mode = mode
            run.step(*built)  # type: ignore[arg-type]

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
    import run

    model, x = run.build("small_mlp", depth, "c")

    def forward(mode: str) -> Callable[[], None]:
        def go() -> None:
            model.mode = mode
            with scopedckpt.checkpointing(enabled=mode == "c"):
                model(x)

        return go

    def global_hooks_off() -> None:
        with _GlobalHooksOff():
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


def dropout_floor(rounds: int) -> dict[str, float]:
    """A 64 x 64 dropout, forward + backward, relative to ``nn.Dropout``."""
    p = 0.1
    x = torch.randn(64, 64, requires_grad=True)
    mask = _mask.Mask(1, p, tuple(x.shape), x.device, alpha=False, save_mask=True)
    scale = mask.scale(x.dtype)

    def one_byte() -> torch.Tensor:
        # What the scoped layer runs below NATIVE_BELOW_ELEMENTS, with none of its
        # bookkeeping: two autograd nodes, 1 byte per element kept.
        return (x * mask.keep()).mul_(scale)

    def four_bytes() -> torch.Tensor:
        # One autograd node, as nn.Dropout: keeps the float noise, 4 bytes per element.
        return x * mask.keep().to(x.dtype).mul_(scale)

    generator = torch.Generator()

    def bits() -> torch.Tensor:
        # What Mask.keep() runs before its compare, at this size (NOTE [ mask bits ]).
        generator.manual_seed(1)
        words = torch.empty((x.numel() // 2,), dtype=torch.int64)
        return _mask._random_words(words, generator)

    reference = nn.Dropout(p)
    layers = {
        "scopedckpt.Dropout(save_mask=True)": scopedckpt.Dropout(p),
        "scopedckpt.Dropout(save_mask=False)": scopedckpt.Dropout(p, save_mask=False),
    }
    variants: dict[str, Callable[[], object]] = {
        "nn.Dropout": lambda: reference(x).sum().backward(),
        **{name: (lambda m=m: m(x).sum().backward()) for name, m in layers.items()},
        "ATen ops, 1 byte kept (two nodes)": lambda: one_byte().sum().backward(),
        "ATen ops, 4 bytes kept (one node)": lambda: four_bytes().sum().backward(),
        "sum + backward alone": lambda: x.sum().backward(),
    }
    median = interleaved(variants, calls=500, rounds=rounds)
    kernels = interleaved(
        {
            "reseed + the mask's bits": bits,
            "reseed + the mask's bits + compare": mask.keep,
            "bernoulli_": lambda: torch.empty_like(x).bernoulli_(1 - p),
        },
        calls=500,
        rounds=rounds,
    )
    base = median["nn.Dropout"]
    result = {name: seconds / base for name, seconds in median.items()}
    result.update({f"{name}, us": seconds * 1e6 for name, seconds in kernels.items()})
    result["nn.Dropout, us"] = base * 1e6
    return result


def dropout_formulations(rounds: int) -> dict[str, dict[str, float]]:
    """Forward + backward of ``scopedckpt.Dropout(0.1)`` in each formulation, by size,
    relative to ``nn.Dropout(0.1)``."""
    reference, layer = nn.Dropout(0.1), scopedckpt.Dropout(0.1)
    threshold = _mask.NATIVE_BELOW_ELEMENTS

    def forced(x: torch.Tensor, native: bool) -> None:
        _mask.NATIVE_BELOW_ELEMENTS = x.numel() + 1 if native else 0
        try:
            layer(x).sum().backward()
        finally:
            _mask.NATIVE_BELOW_ELEMENTS = threshold

    result = {}
    for rows, cols in ((64, 64), (128, 128), (128, 256), (256, 256), (256, 512), (512, 512)):
        x = torch.randn(rows, cols, requires_grad=True)
        median = interleaved(
            {
                "nn.Dropout": lambda x=x: reference(x).sum().backward(),
                "ATen ops": lambda x=x: forced(x, native=True),
                "autograd.Function": lambda x=x: forced(x, native=False),
            },
            calls=max(10, (1 << 18) // x.numel()),
            rounds=rounds,
        )
        base = median.pop("nn.Dropout")
        result[f"{rows}x{cols}"] = {name: seconds / base for name, seconds in median.items()}
    return result


class _Variant:
    """Recomputes in the first forward's formulation and/or masks drawn whole
    (what this release changed; a measurement, the bits are the same)."""

    def __init__(self, first_forwards: bool, whole: bool) -> None:
        self.first_forwards, self.whole = first_forwards, whole

    def __enter__(self) -> None:
        self._saved = _functional.masked_dropout, _mask.PIECES_FROM_ELEMENTS
        if self.first_forwards:
            shipped = _mask.masked_dropout

            def first_forwards(
                input: torch.Tensor, mask: _mask.Mask, inplace: bool, recompute: bool = False
            ) -> torch.Tensor:
                return shipped(input, mask, inplace, recompute=False)

            _functional.masked_dropout = first_forwards  # type: ignore[assignment]
        if self.whole:
            _mask.PIECES_FROM_ELEMENTS = 1 << 62

    def __exit__(self, *exc: object) -> None:
        _functional.masked_dropout, _mask.PIECES_FROM_ELEMENTS = self._saved


def recompute_dropout(depth: int, rounds: int) -> dict[str, float]:
    """The MLP's step time relative to (b), and its peak heap in use (MiB), by variant."""
    import heap
    import run

    b = run.build("mlp", depth, "b")
    c = run.build("mlp", depth, "c")
    variants = {
        "(c)": _Variant(first_forwards=False, whole=False),
        "(c), recomputes in the first forward's formulation": _Variant(True, False),
        "(c), masks drawn whole": _Variant(False, True),
        "(c), both (the previous release)": _Variant(True, True),
    }

    def timed(variant: _Variant) -> Callable[[], None]:
        def step() -> None:
            with variant:
                run.step(*c)

        return step

    median = interleaved(
        {"(b)": lambda: run.step(*b), **{k: timed(v) for k, v in variants.items()}},
        calls=1,
        rounds=rounds,
    )
    result = {f"{k}/(b)": median[k] / median["(b)"] for k in variants}
    result["(b) peak heap, MiB"] = heap.peak_in_use(lambda: run.step(*b)) / 2**20
    for name, variant in variants.items():
        with variant:
            result[f"{name} peak heap, MiB"] = heap.peak_in_use(lambda: run.step(*c)) / 2**20
    return result


def main(rounds: int = 21) -> dict[str, Any]:
    import machinery  # benchmarks/machinery.py

    results: dict[str, Any] = {
        "small_op_gap (small_mlp, 8 blocks)": small_op_gap(8, rounds * 4),
        "machinery (small_mlp, 8 blocks)": machinery.machinery(8, rounds * 5),
        "checkpoint_cost (small_mlp, 8 blocks)": checkpoint_cost(8, rounds * 4),
        "forward_hook_cost (small_mlp, 8 blocks)": forward_hook_cost(8, rounds * 3),
        "region_cost (us)": region_cost(rounds),
        "dropout_floor (64x64, relative to nn.Dropout)": dropout_floor(rounds),
        "recompute_dropout (mlp, 8 blocks)": recompute_dropout(8, rounds * 2),
    }
    for section, values in results.items():
        print(f"\n{section}:")
        for name, value in values.items():
            print(f"  {name:<56}{value:>10.3f}")
    formulations = dropout_formulations(rounds)
    print("\nscoped dropout's two formulations, relative to nn.Dropout:")
    for size, ratios in formulations.items():
        print(f"  {size:<12}" + ", ".join(f"{k}: {v:.2f}" for k, v in ratios.items()))
    return {**results, "dropout_formulations (relative to nn.Dropout)": formulations}


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
