"""Profile a model's training step for the planner: per block, what each choice (no
region, a full region, a region with a ``save=`` preset) keeps, adds to the peak and costs.

NOTE [ peak model ]
===================
A step without checkpointing runs under :class:`~scopedckpt.planner._live.LiveBytes`
(NOTE [ live bytes ]); blocks are numbered in the order their forwards run.
At time t let m(t) be the number of blocks whose kept tensors are *settled*:
in the forward, the blocks whose forward ended; in the backward, the blocks
whose backward has not started (a block's backward starts when the gradient of
its output is computed). ``kept[j]`` is what block j keeps: the bytes of the
storages it created still alive when the forward ends. Then

    live(t) = other(t) + sum(kept[j] for j < m(t))

where *other* is everything else: the stem's and head's tensors, gradients
as they accumulate, temporaries, the part of a running block not settled yet.
A plan changes only what settled blocks keep, so its peak is

    max over m of  floor[m] + sum(kept_c[j] for j < m),
    floor[m] = max(live(t) for m(t) = m) - sum(kept[j] for j < m)

plus, for each block i given a region, the moment its recompute peaks, in its
backward: the blocks before i settled under the plan, block i's region and
what its recompute rebuilds on top. That moment is measured, not modelled: a
second counted step makes every block a full region and takes, for each, the
most bytes live during its backward, or during its first forward where that is
more (verified: fingerprints are taken there), less what the blocks up to it keep
there (``rebuild``; what a full region keeps is measured there too: its output, and
any record the region holds, its fingerprints included: that step verifies every
region bit for bit, as a step does at each site's first call and sampled
ones). A ``save=`` preset keeps the outputs of the ops it selects besides, on
the region's tape until the block's backward ends, where a full region's
recomputed tensors die as backward reads them: its recompute is bounded by the
full region's, on top of what it keeps (measured on ResNet-18, taking it as the
full region's less the bytes it keeps put a plan's peak 0.8 % above its budget,
with the kept outputs alive at the block's last convolution backward). The
model gives the peak without regions exactly and the one with every block a
full region exactly; mixed plans assume the rest of the step is unchanged but
for the inputs regions hold (NOTE [ inputs regions hold ] in ``_held.py``), which
:mod:`benchmarks.plan` checks against measured peaks.

Added cost: the cost of the ops of the block's forward, counted in the step
without regions, as NOTE [ counted costs ] in ``_costs.py`` prices them (a
preset's kept ops less their kernels' part): never timed, so the same in every
run. Timed is only the step without regions, to report costs as time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from .. import policies
from ..core._errors import ScopedCkptError
from ..core._policy import as_policy
from ..core._sampling import suspended
from ..core._scope import checkpointing
from ._costs import CONSTANTS, Constants, op_cost
from ._held import held_inputs, late_floors
from ._live import OUTSIDE, LiveBytes, tensors
from ._solve import Choice, peak_of
from ._untouched import Untouched

__all__ = ["PRESETS", "BlockProfile", "Choice", "Profile", "default_loss", "profile_step"]

PRESETS: dict[str, tuple[Any, ...]] = {
    "matmuls": policies.save_matmuls,
    "attention": policies.save_attention,
    "convolutions": policies.save_convolutions,
    "compute": policies.save_compute,
}
"""The ``save=`` presets a plan may give a block, by the name plans print and store."""


@dataclass(frozen=True)
class BlockProfile:
    """A block as the profile saw it, with the choices open to it."""

    name: str
    module: nn.Module
    choices: tuple[Choice, ...]


@dataclass(frozen=True)
class Profile:
    """What :func:`profile_step` measured (NOTE [ peak model ])."""

    blocks: tuple[BlockProfile, ...]  # in the order their forwards ran
    floors: tuple[int | None, ...]  # floor[m] for m = 0..len(blocks); None: never seen
    late: tuple[int | None, ...]  # late[m], NOTE [ inputs regions hold ]; None: none
    peak: int  # the step's peak without checkpointing
    step_cost: int  # the step's cost without checkpointing (NOTE [ counted costs ])
    step_seconds: float  # the step's time without checkpointing, counted
    costs: str  # the device type whose constants priced it (_costs.CONSTANTS)
    unused: tuple[str, ...]  # candidate blocks the step did not run
    seconds: float  # how long profiling took

    def predicted_peak(self, choices: Sequence[int]) -> int:
        """The predicted peak of the plan giving each block the option of that index."""
        return peak_of(self.floors, [b.choices for b in self.blocks], choices, self.late)


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a step when none is given: the output's ``loss`` if it has one
    (Hugging Face models given labels), else the sum of its first floating tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    for tensor in tensors(output):
        if tensor.is_floating_point() and tensor.requires_grad:
            return tensor.sum()
    raise ScopedCkptError(
        f"scopedckpt: plan() found no floating-point tensor that requires grad in the "
        f"model's output ({type(output).__name__}) to take as the loss. Pass loss_fn=, a "
        "function from the output to the scalar your training step calls backward() on."
    )


class _Instrumented:
    """A counted step's hooks and tallies (see NOTE [ peak model ]); given a ``machine``,
    also what each op costs and what each ``save=`` preset would keep, rebuild and
    spare (the step without regions: NOTE [ counted costs ])."""

    def __init__(
        self,
        blocks: list[tuple[str, nn.Module]],
        untouched: Untouched,
        machine: Constants | None,
    ) -> None:
        self.blocks = blocks
        self.index = {id(module): i for i, (_, module) in enumerate(blocks)}
        self.order: list[int] = []  # block index at each forward position
        self.position: dict[int, int] = {}
        observe = self._observe if machine else None
        self.counter = LiveBytes(observe, untouched.before_op, self._freed)
        self.m = 0
        self.segments: dict[int, int] = {}
        self.ended = False  # the forward (the loss included)
        self.forward_segments: dict[int, int] = {}  # the segments before it ended, and after
        self.backward_segments: dict[int, int] = {}
        self.inputs: dict[int, dict[int, tuple[int, int]]] = {}  # position -> serial -> bytes, tag
        self.freed_at: dict[int, int] = {}  # an input's serial -> the m it was freed at
        self.taken: set[int] = set()  # the inputs' serials
        self.out: dict[int, dict[int, int]] = {}  # position -> serial -> bytes
        self.backward_started: set[int] = set()
        self.backward_block: int | None = None  # the block whose backward runs
        self.backward_peak: dict[int, int] = {}  # its most bytes live, recompute included
        self.machine = machine
        self.ops: dict[int, int] = {}  # per block, the ops of its forward
        self.work: dict[int, int] = {}  # and their flops and bytes terms
        self.step_cost = 0
        made = {name: as_policy(items) for name, items in PRESETS.items()} if machine else {}
        # as_policy gives None for an empty preset (no fused attention kernels).
        self.presets = {name: policy for name, policy in made.items() if policy is not None}
        self.selecting: dict[Any, tuple[str, ...]] = {}  # op -> the presets selecting it
        self.preset_work: dict[tuple[str, int], int] = {}  # the kept ops' flops and bytes
        self.preset_kept: dict[tuple[str, int], dict[int, int]] = {}

    def close(self, m: int) -> None:
        counter = self.counter
        self.segments[self.m] = max(self.segments.get(self.m, 0), counter.peak)
        if self.backward_block is not None:
            k = self.backward_block
            self.backward_peak[k] = max(self.backward_peak.get(k, 0), counter.peak)
        part = self.backward_segments if self.ended else self.forward_segments
        part[self.m] = max(part.get(self.m, 0), counter.peak)
        self.m = m
        counter.restart_peak()

    def _observe(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        assert self.machine is not None  # observed only with one
        op, work = op_cost(self.machine, func, args, kwargs, out)
        self.step_cost += op + work
        k = self.counter.tag
        if k == OUTSIDE:
            return
        self.ops[k] = self.ops.get(k, 0) + 1
        self.work[k] = self.work.get(k, 0) + work
        selecting = self.selecting.get(func)
        if selecting is None:
            selecting = self.selecting[func] = tuple(
                name for name, policy in self.presets.items() if policy.names(func)
            )
        for name in selecting:
            key = (name, k)
            self.preset_work[key] = self.preset_work.get(key, 0) + work
            kept = self.preset_kept.setdefault(key, {})
            for nbytes, _, serial in self.counter.counted(out):
                kept.setdefault(serial, nbytes)

    def _freed(self, serial: int, nbytes: int) -> None:
        if not self.ended and serial in self.taken:
            self.freed_at[serial] = self.m

    def pre(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        i = self.index[id(module)]
        name = self.blocks[i][0]
        if i in self.position:
            raise ScopedCkptError(
                f"scopedckpt: block {name!r} ran twice in one step; plan() gives each block "
                "one choice for one call. Pass blocks= without it (a block called twice, "
                "such as a shared layer, can still be a region by hand)."
            )
        if self.counter.tag != OUTSIDE:
            outer = self.blocks[self.order[self.counter.tag]][0]
            raise ScopedCkptError(
                f"scopedckpt: block {name!r} runs inside block {outer!r}; plan() needs "
                "blocks that do not nest. Pass blocks= with one of the two levels."
            )
        k = len(self.order)
        self.order.append(i)
        self.position[i] = k
        self.close(k)
        self.counter.tag = k
        inputs = {serial: (b, tag) for b, tag, serial in self.counter.counted((args, kwargs))}
        self.inputs[k] = inputs
        self.taken.update(inputs)

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        k = self.position[self.index[id(module)]]
        counter = self.counter
        out = self.out.setdefault(k, {})
        for tensor in tensors(output):
            for nbytes, tag, serial in counter.counted(tensor):
                if tag == k:
                    out[serial] = nbytes
            if tensor.requires_grad:
                tensor.register_hook(self._backward_hook(k))
        counter.tag = OUTSIDE
        self.close(k + 1)

    def _backward_hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def started(grad: torch.Tensor) -> None:
            if k not in self.backward_started:
                self.close(k)
                self.backward_block = k
                self.backward_started.add(k)

        return started


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that wall time measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
) -> Profile:
    """Run two counted steps of ``model``, one without checkpointing and one with every
    block a full region, leaving no trace (NOTE [ leaving no trace ]), and return what
    the planner needs (NOTE [ peak model ], NOTE [ counted costs ])."""
    began = time.perf_counter()
    inputs = tuple(tensors((args, kwargs)))

    def step(tally: _Instrumented, scope: Any) -> tuple[list[int], set[int]]:
        handles = []
        for _, module in tally.blocks:
            handles.append(module.register_forward_pre_hook(tally.pre, with_kwargs=True))
            handles.append(module.register_forward_hook(tally.post))
        try:
            with tally.counter:
                with scope, torch.enable_grad():
                    loss = loss_fn(model(*args, **kwargs))
                kept = [tally.counter.by_tag.get(k, 0) for k in range(len(tally.order))]
                alive = tally.counter.alive()
                tally.close(tally.m)
                tally.ended = True
                loss.backward()
                del loss
                tally.close(tally.m)
            return kept, alive
        finally:
            for handle in handles:
                handle.remove()
            untouched.clear_grads()

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    costs = "cpu" if device.type == "cpu" else "cuda"  # any accelerator: CUDA's
    machine = CONSTANTS[costs]
    with Untouched(model, inputs) as untouched:
        tally = _Instrumented(blocks, untouched, machine)
        synchronize(device)
        start = time.perf_counter()
        kept, alive = step(tally, checkpointing(enabled=False))
        synchronize(device)
        step_seconds = time.perf_counter() - start
        ran = [blocks[i] for i in tally.order]
        full = _Instrumented(ran, untouched, None)
        # Verified bit for bit, as each site's first call and sampled ones are: what a
        # full region keeps includes its fingerprints, so a verified step fits the plan.
        regions = checkpointing(*(module for _, module in ran), determinism_check="bitwise")
        with suspended():
            kept_full, _ = step(full, regions)
        if full.order != list(range(len(ran))):
            raise ScopedCkptError(
                "scopedckpt: plan() saw the blocks run in another order in its second step; "
                "it needs a step whose blocks run the same way every time."
            )
    settled = list(accumulate(kept, initial=0))  # what the blocks before m keep
    settled_full = list(accumulate(kept_full, initial=0))
    floors = tuple(
        tally.segments[m] - below if m in tally.segments else None
        for m, below in enumerate(settled)
    )
    held = held_inputs(tally.inputs, alive, tally.freed_at, len(tally.order))
    late = late_floors(settled, tally.forward_segments, tally.backward_segments, held.shared)
    profiled = []
    for k, i in enumerate(tally.order):
        name, module = blocks[i]
        ops, work = tally.ops.get(k, 0), tally.work.get(k, 0)
        cost = ops * machine.op + work + machine.region  # its forward's ops, again
        # What its region holds of its inputs (NOTE [ inputs regions hold ] in _held.py).
        # Its input from the block before counts here, not in that block's region.
        holds = held.alone.get(k, 0) + held.handed.get(k, 0) - held.handed.get(k + 1, 0)
        choices = [Choice("none", kept[k], 0, None)]
        if k in full.backward_peak:
            # Bytes at the region's peak besides what blocks up to k keep (measured): its
            # recompute's, or its verified first forward's (fingerprints being taken).
            peak = max(full.backward_peak[k], full.forward_segments.get(k, 0))
            rebuild = peak - settled_full[k + 1] + held.handed.get(k + 1, 0)
            choices.append(Choice("full", kept_full[k] + holds, cost, rebuild))
            seen: set[tuple[int, int]] = set()
            for preset in tally.presets:
                selected = tally.preset_kept.get((preset, k))
                if not selected:
                    continue
                extra = sum(b for s, b in selected.items() if s not in tally.out.get(k, {}))
                # The kept ops' kernels are not run again; their calls (OP) still are.
                spared_work = tally.preset_work[(preset, k)]
                if (extra, spared_work) in seen:
                    continue  # the same ops as an earlier preset (compute = matmuls here)
                seen.add((extra, spared_work))
                selective = cost - spared_work + machine.selective * ops
                selective += extra * machine.kept >> 20  # fresh memory (NOTE [ counted costs ])
                # Its recompute at most the full region's (NOTE [ peak model ]).
                kept_preset = kept_full[k] + holds + extra
                choices.append(Choice(preset, kept_preset, selective, rebuild))
        profiled.append(BlockProfile(name, module, tuple(choices)))
    unused = tuple(name for i, (name, _) in enumerate(blocks) if i not in tally.position)
    return Profile(
        tuple(profiled),
        floors,
        late,
        max(tally.segments.values(), default=0),
        tally.step_cost,
        step_seconds,
        costs,
        unused,
        time.perf_counter() - began,
    )
