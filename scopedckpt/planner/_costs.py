"""What an op costs a recompute, counted from its shapes, never timed: so that the same
model, inputs and budget give the same plan in every run and process.

NOTE [ counted costs ]
======================
A plan is a promise, and a choice that follows one noisy step's timings is
not one: identical blocks would swap places between runs. So the solver only
sees costs counted from what the profiling step's ops are, in the counting
mode that already sees each of them (NOTE [ live bytes ]):

    cost(op) = OP + flops(op) // FLOPS + bytes(op) // BYTES

in integer nanoseconds at the fixed constants of the op's device type
(:data:`CONSTANTS`), where ``flops`` is ``torch.utils.flop_counter``'s
formula for the op where it has one (matmuls, convolutions, attention) and 0
elsewhere, and ``bytes`` what the op reads and writes (its tensor arguments
and outputs). A full region costs the ops of its block's forward plus REGION
(setting it up, its hooks, its record); a ``save=`` preset costs that less
the ``flops`` and ``bytes`` terms of the ops it keeps (their OP is still paid:
the op is called and hands back what was kept), plus SELECTIVE per op of the
block (selective saving's dispatch mode, in both passes), plus KEPT per MiB
that the preset keeps beyond a full region. Integers add up
exactly, so equal blocks cost exactly the same, and ties among plans are
broken by a fixed rule (NOTE [ planning as a dynamic program ]).

The constants are an assumed machine, not a measured one: they order the
choices, and the plan reports its time as these costs scaled by the step's
time as measured while planning, which decides nothing. KEPT is the one
measured: on CPU, outputs a preset keeps cost time besides their bytes (memory
held through the forward instead of reused, the allocator hands out fresh
pages). Over the benchmark's CNN, transformer, GPT-2, BERT and ResNet-18, a
preset's measured cost beyond its counted one was 0.54-0.80 ns per byte it kept
beyond a full region (15 paired rounds each); without it the planner gave
convolutions and matmuls presets that measured slower than the full regions
they displaced. The caching allocators of accelerators reuse blocks: 0 there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils.flop_counter import flop_registry

from ._live import tensors

__all__ = ["CONSTANTS", "Constants", "op_cost"]


@dataclass(frozen=True)
class Constants:
    """The assumed machine of NOTE [ counted costs ], in nanoseconds, flops and bytes."""

    op: int  # per op: dispatch, Python, a kernel launch
    flops: int  # flops per nanosecond
    bytes: int  # bytes read or written per nanosecond
    region: int  # per region
    selective: int  # per op of a region with a save= preset
    kept: int  # per MiB a save= preset keeps beyond a full region


# The CPU's: a server core pair (two threads) as the benchmarks run; CUDA's, for any
# accelerator: a recent data-center GPU, whose eager ops are bound by the host when small.
CONSTANTS: dict[str, Constants] = {
    "cpu": Constants(op=5_000, flops=300, bytes=12, region=70_000, selective=8_000, kept=670_000),
    "cuda": Constants(
        op=10_000, flops=50_000, bytes=2_000, region=100_000, selective=10_000, kept=0
    ),
}


_FORMULAS: dict[Any, Any] = {}  # op -> its flop formula, or None


def op_cost(
    machine: Constants, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> tuple[int, int]:
    """(``OP``, the flops and bytes terms) of one op call (NOTE [ counted costs ])."""
    formula = _FORMULAS.get(func, _FORMULAS)
    if formula is _FORMULAS:
        formula = _FORMULAS[func] = flop_registry.get(getattr(func, "_overloadpacket", None))
    flops = 0
    if formula is not None:
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take these arguments counts none
            flops = 0
    moved = sum(t.numel() * t.element_size() for t in tensors((args, kwargs, out)))
    return machine.op, flops // machine.flops + moved // machine.bytes
