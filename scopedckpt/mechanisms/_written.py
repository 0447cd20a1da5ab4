"""Parameters and buffers a region's forward writes outside the buffer guard's view,
replayed from copies taken when the region starts: a region mechanism.

NOTE [ unguarded writes ]
=========================
A recompute runs a region's forward again. The buffer guard (NOTE [ buffer
guard ] in ``_guard.py``) swaps copies in for the buffers of the modules the
region *calls* (with their submodules'), of their values before the first, and
scoped batch norm keeps its own. Writes outside those calls escape both, and a
recompute would repeat them on the real tensors (or on the guard's copies,
which already hold them) and compute from their new values:

* a buffer written other than by its module's own forward (issue 25, hole 4):
  a memory bank pushed through a method (``self.bank.push(k)``, called or not
  as a module), a child's statistics the parent's forward updates;
* a parameter changed in place in forward (hole 3): ``nn.Embedding(max_norm=...)``
  renormalizes rows of its weight at every call, and renormalized rows
  renormalized again change bits on some steps.

A region over a module (its owner, the module it calls, or the layer of a bound
method or ``partial``) notes, when it starts, the version counters of the
parameters and guarded buffers of that module's subtree (an in-place write moves
a version, through views too; an assignment replaces the tensor), and copies
those that regions over this module were seen to write. Until a region over the
module is first recomputed (the first step's forward: every region of the model
has run once; again after any module registered something, when the listing in
``_subtree.py`` is made again) it copies all of them that may be written: every
guarded buffer, and the parameters of modules whose forward may write them (any
module but torch's and scopedckpt's own layers, and among those embeddings with
``max_norm`` and recurrent layers). Regions over one module may run different
code (``checkpoint(self.run_block, i, x)``), hence the whole first step. When
its first forward ends:

* a tensor it wrote and copied keeps its copy on the tape, and every recompute
  swaps a fresh copy in for the tensor while the recompute runs (in the module's
  ``_buffers`` or ``_parameters``, every registration in the subtree), then puts
  the real one back: the recompute computes from the values before the region
  and writes nothing real, however it writes (called or not, in place or by
  assignment). A parameter's copy is an ``nn.Parameter`` too; gradients still
  reach the real one, since backward runs the first forward's graph and takes
  only saved tensors' values from the recompute. The guard leaves such copies
  alone (``SWAPPED``). A region nested in another runs its forward again
  inside the outer one's recompute: there it leaves alone the tensors the outer
  one swapped (whose copies hold the values its first forward found, and must
  take its writes);
* a buffer it wrote without a copy, of a module the forward called, is the
  guard's case, and is copied from the next region on;
* a buffer it wrote without a copy, of a module it never called, and a
  parameter it wrote without a copy (a write no region over the module made in
  the first step, or a parameter of one of torch's own layers), cannot be
  replayed: a :class:`ScopedCkptError` names it and the fix, before any
  backward.

Not seen: writes that move no version (through ``.data``, or kernels that update
their arguments without one) but those a guarded call makes to its module's or
its submodules' buffers (the guard copies those whatever their versions), and
tensors outside the subtree, which sampled
verification (NOTE [ sampled verification ]) catches when they reach a saved
tensor. The cost, for a model whose modules write tensors: one more copy of each
written tensor per region (for batch norms not converted, their step counter),
and in the first step one copy per region of every tensor of its subtree that
may be written, freed when its first forward ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from ..core._errors import ScopedCkptError
from ..core._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape, module_path, region_name
from ..core._subtree import Listing, current_parameters, subtree
from ..core._torch_private import module_buffers, module_parameters, version_of
from ._guard import modules_called
from ._module_state import SWAPPED as _SWAPPED
from ._module_state import Swapped, put_back, swap
from ._report import stats_of

__all__ = ["FRAME_PHASES", "Copies", "Noted", "enter_frame", "start_region"]

_NONE: dict[int, Tensor] = {}  # no copies (shared, never written)

FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})


@dataclass(slots=True, eq=False)
class Copies:
    """What a region's recomputes swap in (``tape.written`` after its first forward)."""

    listing: Listing
    # each buffer the first forward wrote and copied, as (module, name, value before)
    buffers: tuple[tuple[nn.Module, str, Tensor], ...]
    # each parameter it wrote, as (where it is registered, value before, requires_grad)
    parameters: tuple[tuple[tuple[tuple[nn.Module, str], ...], Tensor, bool], ...] = ()


@dataclass(slots=True, eq=False)
class Noted:
    """A region's subtree as its first forward starts (``tape.written`` until it ends)."""

    call: RegionCall
    listing: Listing
    parameters: tuple[Tensor, ...]  # listing.parameters as registered when it started
    versions: list[int]  # of parameters
    # each guarded buffer there now as (module's qualified name, module, name, tensor)
    buffers: Sequence[tuple[str, nn.Module, str, Tensor]]
    buffer_versions: Sequence[int]
    copies: dict[int, Tensor]  # by index into buffers: its value before the region
    parameter_copies: dict[int, Tensor]  # by index into listing.parameters: the same


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Note the versions of the subtree's parameters and buffers and copy the buffers
    regions over this module write; acts in its frames."""
    module = call.module
    if module is None:
        return False
    listing = call.listing if call.listing is not None else subtree(module)
    parameters = listing.objects
    if parameters is None:
        parameters = current_parameters(listing)
        if not _SWAPPED.get():  # the real ones: kept until the subtree registers anything
            listing.objects = parameters
    if not parameters and not listing.buffers:
        return False
    learning = listing.learning
    copied = listing.writable if learning else listing.written_parameters
    parameter_copies = {i: parameters[i].detach().clone() for i in copied} if copied else _NONE
    versions = list(map(version_of, parameters))
    if not listing.buffers:
        tape.written = Noted(call, listing, parameters, versions, (), (), _NONE, parameter_copies)
        return True
    buffers: list[tuple[str, nn.Module, str, Tensor]] = []
    copies: dict[int, Tensor] = {}
    learned = listing.written
    for qualified, holder_ref, name in listing.buffers:
        holder = holder_ref()
        if holder is None:  # taken out of the subtree since listed, and gone
            continue
        b = module_buffers(holder).get(name)
        if b is None or is_lazy(b):
            continue
        if learning or (qualified, name) in learned:
            copies[len(buffers)] = b.clone()
        buffers.append((qualified, holder, name, b))
    buffer_versions = [version_of(b) for *_, b in buffers]
    tape.written = Noted(
        call, listing, parameters, versions, buffers, buffer_versions, copies, parameter_copies
    )
    return True


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """The first forward: check what it wrote when it ends. A recompute: swap copies in
    for the buffers the first forward wrote, until it ends."""
    if frame.phase is not RECOMPUTE:
        return functools.partial(_check, frame)
    copies = frame.tape.written
    if not isinstance(copies, Copies):
        if isinstance(copies, Listing):
            copies.learning = False
        return None
    copies.listing.learning = False
    swapped = _SWAPPED.get()  # set below too: a nested region's recompute continues on them
    found: Swapped = []
    keys = []
    for holder, name, before in copies.buffers:
        key = (id(holder), name)
        if key in swapped:  # an enclosing recompute's copy: continue on it
            continue
        keys.append(key)
        # A copy: a later recompute needs `before` again.
        swap(module_buffers(holder), name, before.clone(), found)
    for slots, before, requires_grad in copies.parameters:
        if (id(slots[0][0]), slots[0][1]) in swapped:
            continue
        # The recompute computes the saved tensors' values from it; gradients flow through
        # the first forward's graph, to the real parameter.
        copy = nn.Parameter(before.clone(), requires_grad=requires_grad)
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


def _check(frame: Frame, exc_type: object, *exc: object) -> None:
    noted, frame.tape.written = frame.tape.written, None  # the check runs once
    if exc_type is not None or not isinstance(noted, Noted):
        return
    listing, parameters = noted.listing, noted.parameters
    moved_any = list(map(version_of, parameters)) != noted.versions
    if not moved_any and not noted.buffers:  # the common case: nothing to keep
        frame.tape.written = listing if listing.learning else None
        return
    call = noted.call
    kept_parameters = []
    if moved_any:
        moved = set()
        for index, (p, version) in enumerate(zip(parameters, noted.versions)):
            if version_of(p) != version:
                moved.add(index)
                copy = noted.parameter_copies.get(index)
                if copy is None:
                    listing.written_parameters |= moved
                    raise ScopedCkptError(_parameter_message(call, listing.parameters[index]))
                slots = tuple((m, n) for ref, n in listing.slots[index] if (m := ref()) is not None)
                kept_parameters.append((slots, copy, p.requires_grad))
        listing.written_parameters |= moved
    kept: list[tuple[nn.Module, str, Tensor]] = []
    wrote: set[tuple[str, str]] = set()
    unforeseen: list[tuple[nn.Module, str]] = []
    for index, ((qualified, holder, name, b), version) in enumerate(
        zip(noted.buffers, noted.buffer_versions)
    ):
        if module_buffers(holder).get(name) is b and version_of(b) == version:
            continue
        wrote.add((qualified, name))
        copy = noted.copies.get(index)
        if copy is not None:
            kept.append((holder, name, copy))
        else:
            unforeseen.append((holder, name))
    if not wrote <= listing.written:
        # Copied from the next region on: a write its module's calls made, which the guard
        # covers, may be made outside them next time.
        listing.written |= wrote
    if unforeseen:
        called = _called(frame.tape)
        for holder, name in unforeseen:
            if id(holder) not in called:
                raise ScopedCkptError(_buffer_message(call, holder, name))
    if not kept and not kept_parameters:
        # Nothing to swap: a recompute only ends the listing's learning, if it still is.
        frame.tape.written = listing if listing.learning else None
        return
    frame.tape.written = Copies(listing, tuple(kept), tuple(kept_parameters))
    stats = stats_of(frame.tape)
    if stats is not None:  # the memory report's row counts the copies as kept
        stats.kept_bytes += sum(copy.nbytes for *_, copy in kept)
        stats.kept_bytes += sum(copy.nbytes for _, copy, _ in kept_parameters)


def _called(tape: Tape) -> set[int]:
    """Every module the first forward called, by id, nested regions' calls included."""
    called = modules_called(tape)
    for record in tape.records:
        if isinstance(record.value, Tape):  # a nested region's tape
            called |= _called(record.value)
    return called


def _parameter_message(call: RegionCall, name: str) -> str:
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


def _buffer_message(call: RegionCall, module: nn.Module, name: str) -> str:
    return (
        f"scopedckpt: {region_name(call)} changed buffer {name!r} of a module it never "
        "called: make the write in that module's forward, and call it.\n"
        f"It is buffer {name!r} of {module_path(module, None, call.scope)}, written through "
        "a method (self.bank.push(k)) or by another module's forward, and the regions over "
        "this module did not change it in the first step, so no copy was taken: the "
        "recompute in backward would see the new values and write them again. scopedckpt "
        "copies the buffers that regions over a module wrote in the first step. Other "
        "fixes: make this write happen in the first step as well (with a zero update, say), "
        "or make it outside the region."
    )
