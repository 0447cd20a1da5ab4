"""Parameters and buffers a region's forward changes where no guard sees it, refused: a
region mechanism.

NOTE [ unguarded writes ]
=========================
A recompute runs a region's forward again. The buffer guard (NOTE [ buffer
guard ] in ``_guard.py``) keeps it from changing the buffers of the modules the
region calls a second time, and scoped batch norm keeps its own. Two kinds of
write escape both, and a recompute would repeat them on the real tensors and
compute from their new values:

* a parameter changed in place in forward: ``nn.Embedding(max_norm=...)``
  renormalises rows of its weight at every call (issue 25, hole 3), and the
  renormalised rows are renormalised again, changing bits on some steps;
* a buffer of a module the region does not call: written by a method
  (``self.bank.push(k)``) or by another module's forward (issue 25, hole 4).

When a region whose owner is a module starts, this mechanism notes the
version counters of the parameters and buffers in the owner's subtree (an
in-place write moves a version, through views too, and an assignment replaces
the tensor); when its first forward ends it raises :class:`ScopedCkptError`,
before any backward, naming the tensor's qualified name and the fix if a
parameter moved, or a buffer of a module the forward did not call. Not seen:
writes that move no version (through ``.data``, or by kernels such as batch
norm's that update their arguments without one), which sampled verification
(NOTE [ sampled verification ]) may catch when they reach a saved tensor, and
tensors outside the owner's subtree. The subtree's tensors are listed once per
owner (``_subtree.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from ._errors import ScopedCkptError
from ._module_state import guarded
from ._state import FORWARD, Frame, RegionCall, Tape, module_path
from ._subtree import subtree
from ._torch_private import module_buffers, version_of

__all__ = ["FRAME_PHASES", "Noted", "enter_frame", "start_region"]

FRAME_PHASES = frozenset({FORWARD})

# The region's call; the owner's parameters by qualified name and their versions; each
# buffer whose module the guard would guard when called, as (module, name, tensor), and
# their versions.
Noted = tuple[
    RegionCall,
    tuple[tuple[str, Tensor], ...],
    list[int],
    list[tuple[nn.Module, str, Tensor]],
    list[int],
]


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Note the versions of the owner's parameters and buffers; acts in its first forward."""
    owner = call.owner
    if not isinstance(owner, nn.Module):
        return False
    parameters, holders, _ = subtree(owner)
    if not parameters and not holders:
        return False
    buffers = [
        (module, name, b)
        for _, module in holders
        if guarded(module)  # scoped batch norm keeps its own
        for name, b in module_buffers(module).items()
        if b is not None and not is_lazy(b)
    ]
    tape.written = (
        call,
        parameters,
        [version_of(p) for _, p in parameters],
        buffers,
        [version_of(b) for _, _, b in buffers],
    )
    return True


def enter_frame(frame: Frame) -> Callable[..., None]:
    """The first forward: check the noted tensors when it ends without an error."""
    return functools.partial(_check, frame)


def _check(frame: Frame, exc_type: object, *exc: object) -> None:
    noted, frame.tape.written = frame.tape.written, None  # the check runs once
    if exc_type is not None or noted is None:
        return
    call, parameters, versions, buffers, buffer_versions = noted
    if [version_of(p) for _, p in parameters] != versions:
        for (name, p), version in zip(parameters, versions):
            if version_of(p) != version:
                raise ScopedCkptError(_parameter_message(call, name))
    called: set[int] | None = None
    for (module, name, b), version in zip(buffers, buffer_versions):
        if module_buffers(module).get(name) is b and version_of(b) == version:
            continue
        if called is None:
            called = _called(frame.tape)
        if id(module) not in called:
            raise ScopedCkptError(_buffer_message(call, module, name))


def _called(tape: Tape) -> set[int]:
    """Every module the first forward called, by id, nested regions' calls included."""
    called = set(tape.modes)
    for record in tape.records:
        if isinstance(record.value, Tape):  # a nested region's tape
            called |= _called(record.value)
    return called


def _region(call: RegionCall) -> str:
    return f"the forward of {module_path(call.owner, None, call.scope)}"


def _parameter_message(call: RegionCall, name: str) -> str:
    return (
        f"scopedckpt: the checkpoint region {_region(call)} changed its parameter {name!r} "
        "in place during its forward (nn.Embedding(max_norm=...) renormalizes rows of its "
        "weight at every call). The recompute in backward would change it again and compute "
        "from the changed values, so the gradients would not be plain training's. Keep that "
        "module out of checkpoint regions (checkpoint the blocks after it), or make the "
        "change outside the region (for an embedding: renormalize the weight before the "
        "step under torch.no_grad() and pass max_norm=None)."
    )


def _buffer_message(call: RegionCall, module: nn.Module, name: str) -> str:
    return (
        f"scopedckpt: the checkpoint region {_region(call)} changed buffer {name!r} of "
        f"{module_path(module, None, call.scope)}, a module it never called: written "
        "through a method (self.bank.push(k)) or by another module's forward. The buffer "
        "guard copies the buffers of modules the region calls, so the recompute in backward "
        "would see the new values and write them again. Make the update that module's own "
        "forward and call the module (bank(k)), or make it outside the region (on its "
        "output, after the checkpointed call)."
    )
