"""Parameters a region's forward changes in place, replayed from copies taken when the
region starts: a region mechanism.

NOTE [ written parameters ]
===========================
A recompute runs a region's forward again. A forward that changes a parameter
in place (``nn.Embedding(max_norm=...)`` renormalizes rows of its weight at
every call, and renormalized rows renormalized again change bits on some steps)
would change it again and compute from the changed values. Buffers are the
buffer guard's (NOTE [ buffer guard ] in ``_guard.py``), which records the
buffers of the region's whole subtree when it starts, called or not.

A region over a module (its owner, the module it calls, or the layer of a bound
method or ``partial``) notes, when it starts, the version counters of its
subtree's parameters (an in-place write moves a version, through views too),
and copies those that regions over this module were seen to change. Until a
region over the module is first recomputed (the first step's forward: every
region of the model has run once; again after any module registered something,
when the listing in ``_subtree.py`` is made again) it copies every parameter of
modules whose forward may change them (any module but torch's and scopedckpt's
own layers, and among those embeddings with ``max_norm`` and recurrent layers).
Regions over one module may run different code (``checkpoint(self.run_block,
i, x)``), hence the whole first step. When its first forward ends:

* a parameter it changed and copied keeps its copy on the tape, and every
  recompute swaps a fresh copy, an ``nn.Parameter`` too, in for it (at every
  registration in the subtree) while it runs, then puts the real one back: the
  recompute computes from the values before the region and changes nothing
  real. Gradients still reach the real parameter, since backward runs the first
  forward's graph and takes only saved tensors' values from the recompute. A
  region nested in another runs its forward again inside the outer one's
  recompute: there it leaves alone the tensors the outer one swapped
  (``SWAPPED``), whose copies hold the values its first forward found and must
  take its changes;
* a parameter it changed without a copy (a change no region over the module made
  in the first step, or a parameter of one of torch's own layers) cannot be
  replayed: a :class:`ScopedCkptError` names it and the fix, before any backward.

Not seen: changes that move no version (through ``.data``), which sampled
verification (NOTE [ sampled verification ]) catches when they reach a saved
tensor. The cost: one copy of each changed parameter per region, and in the
first step one copy per region of each parameter that may be changed, freed when
its first forward ends unless it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from ..core._errors import ScopedCkptError
from ..core._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape, region_name
from ..core._subtree import Listing, current_parameters, subtree
from ..core._torch_private import module_parameters, version_of
from ._module_state import SWAPPED as _SWAPPED
from ._module_state import Swapped, put_back, swap
from ._report import stats_of

__all__ = ["FRAME_PHASES", "Written", "enter_frame", "start_region"]

FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})


@dataclass(slots=True, eq=False)
class Written:
    """A region's parameters (``tape.written``; private to this mechanism)."""

    # until the first forward ends (it holds the region's inputs: no cycle through the
    # tape, NOTE [ no cycle through the tape ])
    call: RegionCall | None
    listing: Listing
    parameters: tuple[Tensor, ...]  # listing.parameters as registered when it started
    versions: list[int]  # theirs then, until the first forward ends
    # by index into parameters, the value before the region: of those that may be
    # changed until the first forward ends, of those it changed after
    copies: dict[int, Tensor]


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Note the versions of the subtree's parameters and copy those regions over this
    module change; acts in its frames."""
    module = call.module
    if module is None:
        return False
    listing = call.listing if call.listing is not None else subtree(module)
    parameters = listing.objects
    if parameters is None:
        parameters = current_parameters(listing)
        if not _SWAPPED.get():  # the real ones: kept until the subtree registers anything
            listing.objects = parameters
    if not parameters:
        return False
    copied = listing.writable if listing.learning else listing.written_parameters
    copies = {i: parameters[i].detach().clone() for i in copied}
    tape.written = Written(call, listing, parameters, list(map(version_of, parameters)), copies)
    return True


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """The first forward: check what it changed when it ends. A recompute: swap copies in
    for the parameters the first forward changed, until it ends."""
    written: Written = frame.tape.written
    if frame.phase is not RECOMPUTE:
        return functools.partial(_check, frame.tape)
    written.listing.learning = False
    swapped = _SWAPPED.get()  # set below too: a nested region's recompute continues on them
    found: Swapped = []
    keys = []
    for index, before in written.copies.items():
        slots = [(m, n) for ref, n in written.listing.slots[index] if (m := ref()) is not None]
        if (id(slots[0][0]), slots[0][1]) in swapped:  # an enclosing recompute's copy
            continue
        # The recompute computes the saved tensors' values from it; gradients flow through
        # the first forward's graph, to the real parameter. A fresh copy per recompute.
        copy = nn.Parameter(before.clone(), written.parameters[index].requires_grad)
        for holder, name in slots:
            keys.append((id(holder), name))
            swap(module_parameters(holder), name, copy, found)
    if not found:
        return None
    token = _SWAPPED.set(swapped | frozenset(keys))

    def put_back_reals(*exc: object) -> None:
        _SWAPPED.reset(token)
        put_back(found)

    return put_back_reals


def _check(tape: Tape, exc_type: object, *exc: object) -> None:
    written: Written = tape.written
    call, written.call = written.call, None
    if exc_type is not None or call is None:  # the check runs once
        written.copies = {}
        return
    listing, versions = written.listing, written.versions
    written.versions = []
    now = list(map(version_of, written.parameters))
    if now == versions:  # the common case: nothing changed, nothing to keep
        written.copies = {}
        return
    moved = {i for i, (a, b) in enumerate(zip(now, versions)) if a != b}
    listing.written_parameters |= moved
    unforeseen = moved - written.copies.keys()
    if unforeseen:
        raise ScopedCkptError(_message(call, listing.parameters[min(unforeseen)]))
    written.copies = {i: written.copies[i] for i in moved}
    stats = stats_of(tape)
    if stats is not None:  # the memory report's row counts the copies as kept
        stats.kept_bytes += sum(copy.nbytes for copy in written.copies.values())


def _message(call: RegionCall, name: str) -> str:
    return (
        f"scopedckpt: {region_name(call)} changed parameter {name!r} in place: make that "
        "change outside the region (before the step).\n"
        "No copy was taken to recompute from: scopedckpt copies the parameters that regions "
        "over a module changed in the first step, of modules that may change them (any but "
        "torch's own layers, and embeddings with max_norm), and this one is another layer's, "
        "or was not changed in the first step. The recompute in backward would change it "
        "again and compute from the changed values, so the gradients would not be plain "
        "training's. Other fixes: make the change in the forward of a module of your own that "
        "holds the parameter, or make it in the first step as well. Outside the region: under "
        "torch.no_grad(), before the step."
    )
