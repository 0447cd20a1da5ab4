"""Bitwise verification of recomputes: fingerprints, not copies, of what backward uses.

NOTE [ bitwise verification ]
=============================
torch's ``determinism_check="default"`` compares the shapes, dtypes and
devices of the tensors a recompute saves with the first forward's. With
``determinism_check="bitwise"`` scopedckpt compares their values, bit for
bit, without keeping copies of the activations:

* torch calls a region's ``determinism_check`` function once for every tensor
  its first forward saves for backward, and again for every recomputed one,
  comparing the two results with ``!=`` (its ``_allowed_determinism_checks_to_fns``
  registry, read in ``_torch_private.py``). ``"bitwise"`` registers
  :func:`fingerprint`: a :class:`Fingerprint` of shape, dtype, device and
  two int64 sums of the tensor's bit patterns (the elements viewed as
  integers of their own size), both from one pass that sums each row (the
  last dimension): the sum of all elements, and the row sums weighted by the
  row's index. One changed element changes the first sum (its bit pattern
  changes by less than 2**64); moved rows change the weighted one. Values
  moved within a row (the last dimension permuted, shape unchanged) are not
  seen: the first version's second pass, over columns, with int64 row sums,
  made a fingerprint four times as costly. Two int64 values and a sample of
  64 values kept per saved tensor.
* The first forward's fingerprint is taken when autograd saves the tensor:
  what it saved then is what backward may use (a batch norm's running
  statistics are saved and then updated again by a later call of the same
  module). But some ops save an output before their kernel writes it
  (``rrelu_with_noise`` saves its noise), and backward reads it after the op.
  So in a scopedckpt region's first forward the saved tensors are looked at
  again when the forward ends, and those written in place since they were
  saved (their version counter moved) get a second fingerprint then; a
  recomputed tensor must match one of the two. They are held weakly: a tensor
  the forward freed was not written after it was saved (a program that writes a
  saved tensor in place fails in plain training's backward), so a verified call
  keeps no activation alive that an unverified one frees (NOTE [ no cycle
  through the tape ]): it costs time, and its fingerprints' memory (which a
  plan's peak counts: NOTE [ peak model ]). Only tensors saved under ``F.rrelu`` (whose
  noise the kernel writes after autograd saved it, and which lives only as long
  as the op) are held strongly to the forward's end. The recomputed side is
  fingerprinted when torch checks, after the recompute.
* On a mismatch the first differing tensor (in the order the forward saved
  them) raises :class:`ScopedCkptError` naming the region, the tensor's
  position, shape and dtype, the source line that saved it (the innermost
  frame outside torch and scopedckpt), how many values differ and by how much,
  and the likely causes. How many: a fingerprint also keeps ``SAMPLE`` (64)
  values of the tensor at evenly spaced positions (all of a smaller one), taken
  when it is saved (again when the first forward ends if it was written since),
  and the message counts and measures the differences among them: exact for
  tensors of at most 64 elements, an estimate from the sample for larger ones
  (none differing there means fewer than about 1 in 64 do). Exact counts of a
  large tensor need the first forward's values, which are not kept: the message
  says how to get them (train the step once without checkpointing and compare,
  ``scopedckpt.testing.assert_checkpoint_equivalent``).
* Compiled regions are torch's checkpoint operator, whose recompute is part
  of the compiled backward: nothing there is verified, and ``"bitwise"`` in
  compiled code raises (``_compiled.py``).
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core._errors import ScopedCkptError
from ..core._names import LIBRARY_SOURCES
from ..core._options import BITWISE
from ..core._own_ops import internal
from ..core._state import FORWARD, FRAME, Frame, RegionCall, Tape, region_name
from ..core._torch_private import NormBase, recompute_whole, register_determinism_check, version_of
from ._bits import differences, sample, sums
from ._report import RegionStats, stats_of

__all__ = [
    "FRAME_PHASES",
    "Fingerprint",
    "Verifying",
    "enter_frame",
    "fingerprint",
    "not_verified",
    "not_verified_statistics",
    "start_region",
    "verified_call",
]


class _Counters:
    """How many saved tensors recomputes were compared on, bit for bit (tests read it)."""

    compared = 0


COUNTERS = _Counters()

FRAME_PHASES = frozenset({FORWARD})


@dataclass
class Verifying:
    """A verified region (on its tape): its call, its memory report row, and the
    fingerprints its first forward has still to take."""

    call: RegionCall
    # NOTE [ no cycle through the tape ]: the tape holds this record, so this record does
    # not hold the tape. A cycle would outlive the region's backward until the garbage
    # collector ran, and with it the tape's kept op outputs (a save= policy's, a whole
    # block's worth each): a verified step would peak above the same step unverified.
    stats: RegionStats | None
    pending: list[Fingerprint] = field(default_factory=list)
    saved: int = 0  # tensors its first forward saved so far


# Marks tensors that regions save but whose values are not compared (by shape, dtype
# and device only): normalization layers' running statistics. Backward in training does
# not read them, and a later call of the same module in the region updates them in
# place: compared, a recompute that diverged anywhere before that call would be named at
# the statistics, not at the op that diverged. Recomputes save copies (the buffer
# guard's, scoped batch norm's throwaway ones).
_NOT_VERIFIED = "_scopedckpt_not_verified"


def not_verified(*tensors: Tensor | None) -> None:
    """Compare these saved tensors by shape, dtype and device only."""
    for tensor in tensors:
        if tensor is not None:
            setattr(tensor, _NOT_VERIFIED, True)


def not_verified_statistics(module: object) -> None:
    """A normalization layer's running statistics are not compared (see above)."""
    if isinstance(module, NormBase):
        not_verified(module.running_mean, module.running_var)


def verified_call(tape: Tape) -> RegionCall | None:
    """The call of a region verified bit for bit, else None."""
    return None if tape.verifying is None else tape.verifying.call


def start_region(tape: Tape, call: RegionCall) -> bool:
    """A region with ``determinism_check="bitwise"`` is verified: act in its first forward."""
    if call.determinism_check != BITWISE:
        return False
    tape.verifying = Verifying(call, stats_of(tape))  # _report started before
    return True


def enter_frame(frame: Frame) -> Callable[..., None]:
    """The first forward: take the fingerprints of what it saved when it ends."""
    return functools.partial(_finish, frame)


def _finish(frame: Frame, *exc: object) -> None:
    verifying = frame.tape.verifying
    assert verifying is not None  # start_region said so
    # Messages need the region's name, not its arguments: the tape lives as long as the
    # graph, and holding the inputs would keep each one past its region's backward.
    verifying.call = verifying.call.without_arguments()
    pending, verifying.pending = verifying.pending, []
    with internal():  # not op calls of the region's (NOTE [ selective saving ])
        for print_ in pending:
            print_.take()


# NOTE [ unread saved tensors ]: in eval mode rrelu_with_noise saves its noise
# without writing it, and its backward (leaky ReLU's) never reads it: the forward
# and the recompute each save whatever memory they got. Such a tensor, saved under
# F.rrelu(training=False) with no autograd history, is compared by shape only.
_RRELU = torch.nn.functional.rrelu.__code__


def _source() -> tuple[str, bool | None]:
    """The innermost frame outside torch, scopedckpt and the standard library, and whether
    the tensor is saved under ``F.rrelu``: False in training (NOTE [ late writes ]), True
    in eval mode (NOTE [ unread saved tensors ]), None if not."""
    frame = inspect.currentframe()
    rrelu: bool | None = None
    while frame is not None:
        code = frame.f_code
        if code is _RRELU:
            rrelu = not frame.f_locals.get("training", True)
        if not code.co_filename.startswith(LIBRARY_SOURCES):
            return f"{code.co_filename}:{frame.f_lineno} (in {code.co_name})", rrelu
        frame = frame.f_back
    return "an unknown line", rrelu


class Fingerprint:
    """What ``determinism_check="bitwise"`` keeps of one saved tensor, and compares."""

    __slots__ = (
        "_tensor",
        "_values",
        "_version",
        "device",
        "dtype",
        "index",
        "later",
        "op",
        "region",
        "sample",
        "shape",
        "source",
        "sums",
    )

    def __init__(
        self, x: Tensor, region: Verifying | None, index: int, source: str, hold: bool = False
    ) -> None:
        self.shape, self.dtype, self.device = tuple(x.shape), x.dtype, x.device
        self.region, self.index, self.source = region, index, source
        plain = (
            x.layout == torch.strided and type(x) is Tensor and not getattr(x, _NOT_VERIFIED, False)
        )
        self.sums = sums(x) if plain else None  # as saved
        self.later: Tensor | None = None  # when the first forward ended, if written since
        first = plain and region is not None
        node = x.grad_fn if first else None  # the autograd node that made the tensor
        self.op = (
            "" if node is None else type(node).__name__.removesuffix("0").removesuffix("Backward")
        )
        self.sample: Tensor | None = sample(x) if first else None  # a first forward's
        # A first forward's, looked at again when it ends (take): held weakly, so that a
        # verified call frees what an unverified one frees, but for a tensor an op writes
        # after saving it (``hold``: rrelu's noise), which only lives as long as that op.
        self._tensor: Callable[[], Tensor | None] | None = None
        if first:
            self._tensor = (lambda: x) if hold else weakref.ref(x)
        self._version = version_of(x) if first else 0
        # Anyone else's (torch's check fingerprints a recomputed tensor, which lives on):
        # for the message, without keeping it alive (torch's own checkpoint keeps the
        # fingerprints of its first forward).
        self._values: Callable[[], Tensor | None] | None = (
            weakref.ref(x) if plain and region is None else None
        )

    def take(self) -> None:
        """The first forward ends: fingerprint the tensor again if it was written since it
        was saved, and let it go."""
        held, self._tensor = self._tensor, None
        x = None if held is None else held()
        if x is None:  # freed by the forward: nothing wrote it since it was saved
            return
        node = x.grad_fn
        # Written since saved: in place (the version moved), or by a kernel that moves no
        # version, which only tensors outside the graph (noise, buffers) are.
        if version_of(x) != self._version or (node is None and not x.requires_grad):
            self.later = sums(x)
        self.sample = sample(x)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprint):
            return NotImplemented
        if self._tensor is not None:
            self.take()  # a forward that has not ended: backward inside it
        same = (self.shape, self.dtype, self.device) == (other.shape, other.dtype, other.device)
        if same and self.sums is not None and other.sums is not None:
            COUNTERS.compared += 1
            stats = None if self.region is None else self.region.stats
            if stats is not None:  # a memory_report() block counts it
                stats.verified += 1
            same = torch.equal(self.sums, other.sums) or (
                self.later is not None and torch.equal(self.later, other.sums)
            )
        if not same and self.region is not None:
            # The step is lost, and torch's checkpoint keeps its regions alive in a
            # reference cycle after a failed backward: the module targets are unpatched.
            for patches in self.region.call.scope.patches:
                patches.release_all()
            values = None if other._values is None else other._values()
            raise ScopedCkptError(self._message(other, values))
        return same

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Fingerprint(shape={self.shape}, dtype={self.dtype}, sums={self.sums})"

    def _message(self, recomputed: Fingerprint, values: Tensor | None) -> str:
        assert self.region is not None
        call = self.region.call
        region = region_name(call)
        if (self.shape, self.dtype) != (recomputed.shape, recomputed.dtype):
            what = (
                f"has shape {recomputed.shape} and dtype {recomputed.dtype} in the recompute, "
                f"{self.shape} and {self.dtype} in the first forward"
            )
            counted = ""
        else:
            what = f"({self.dtype}, shape {self.shape}) has other values in the recompute"
            numel = math.prod(self.shape)
            recomputed_sample = None if values is None else sample(values)
            counted = differences(self.sample, recomputed_sample, numel)
        made = f"the output of {self.op}, " if self.op else ""
        return (
            f"scopedckpt: bitwise verification failed in {region}: for state outside its "
            "modules (a global), implement scopedckpt.Stateful.\n"
            f"Its recompute did not reproduce its first forward. Saved tensor #{self.index} "
            f"{what}: {made}saved by the first forward at {self.source}. {counted}"
            "Backward would have used the recomputed values.\n"
            "Likely causes and their fixes:\n"
            "- state the forward changes and reads outside its modules' attributes (a "
            "global, an object that is not a module, a list): implement scopedckpt.Stateful;\n"
            "- an op that writes a saved output after saving it (F.rrelu outside an nn.RReLU "
            "layer): pass early_stop=False;\n"
            "- a buffer the forward changes without moving its version (through .data, or a "
            "kernel such as batch norm's called on another module's buffers): make the module "
            "Stateful or use a scoped layer;\n"
            "- a random op with its own torch.Generator held where the region cannot reach it "
            "(a list, an object that is not a module) and that its earlier verified calls never "
            "used: hold it as a module attribute, or use a scoped layer with generator=...;\n"
            "- control flow that depends on data changed between forward and backward: move it "
            "out of the region.\n"
            "The first forward's values are not kept (fingerprints and a sample only): "
            "scopedckpt.testing.assert_checkpoint_equivalent(model, *inputs) trains the step "
            "both ways and names every value that differs."
        )


def fingerprint(x: Tensor) -> Fingerprint:
    """torch's ``metadata_fn`` for ``determinism_check="bitwise"``: a :class:`Fingerprint`
    of ``x`` now, completed when a verified region's first forward ends."""
    frame = FRAME.get()
    verifying = None if frame is None else frame.tape.verifying
    if verifying is None or frame is None or frame.phase is not FORWARD:
        return Fingerprint(x, None, -1, "")
    source, rrelu = _source()
    if rrelu and x.grad_fn is None and not x.requires_grad:
        not_verified(x)  # NOTE [ unread saved tensors ]
    elif rrelu is False and recompute_whole(1):  # NOTE [ late writes ] in _early_stop.py
        # Imported here: _early_stop lists subtrees through _module_state, which imports
        # this module.
        from ..core._early_stop import late_write_found

        late_write_found(verifying.call.module, verifying.call.fn)
    hold = rrelu is not None  # NOTE [ late writes ]: written after saved, then freed
    with internal():  # not op calls of the region's (NOTE [ selective saving ])
        print_ = Fingerprint(x, verifying, verifying.saved, source, hold)
    verifying.saved += 1
    verifying.pending.append(print_)
    return print_


register_determinism_check(BITWISE, fingerprint)
