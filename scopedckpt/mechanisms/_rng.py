"""Replay of unscoped randomness: a region-level stash of the default generators.

NOTE [ RNG replay ]
===================
Random ops that no scoped layer issues (``F.dropout`` in attention code,
``scaled_dot_product_attention(dropout_p=...)``, ``bernoulli_`` in DropPath,
``torch.rand`` in user code) draw from torch's *default* generators. They are
replayed exactly by giving the recompute the generator states the first
forward started from:

* When a region's first forward starts, :func:`stash` copies the state of the
  default CPU generator and of the default generator of every initialised
  accelerator device (CUDA, XPU, ...: ``torch.accelerator``), onto the tape.
* Every backward recompute sets those states, runs, and puts back the states
  it found (:func:`enter_frame`), so the global streams after ``backward()``
  are those after the forward: the same as without checkpointing.
* Scoped layers stay aligned with that stream (see NOTE [ aligned draws ] in
  ``_dropout.py``): a scoped dropout drawing its seed from the default
  generator in the forward draws it again in the recompute and checks that it
  got the recorded seed. So scoped and unscoped draws can be mixed in any
  order, and a recompute whose stream diverged raises instead of replaying
  wrong masks.
* A nested region replayed inside its parent's recompute sets its stash on
  entry too but does not rewind on exit: the parent's later draws must see the
  stream advanced past the nested region, as in the first forward.

This was chosen over per-op record/replay (a dispatch mode over every op of
every region, and a generator state per random op) because it costs two state
copies per region and nothing per op; ``benchmarks/run.py`` keeps the cost
visible. Random ops given an explicit non-default ``generator=`` are replayed
by another mechanism (NOTE [ explicit generators ] in ``_generators.py``). What
it cannot replay: draws made by another thread on the shared default generator
while a region runs (as for ``torch.utils.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core._state import RECOMPUTE, Frame, RegionCall, Tape

__all__ = [
    "FRAME_PHASES",
    "RngStash",
    "enter_frame",
    "kept_bytes",
    "replays",
    "start_region",
    "stash",
    "states_now",
]

Access = tuple[Callable[[], Tensor], Callable[[Tensor], None]]


def _accelerator_generators() -> list[Access]:
    """Get/set functions for the default generator of each initialised accelerator device.

    Only initialised devices: a region must not initialise CUDA by asking. Tests
    replace this function to check the device path without a device.
    """
    # Asked at every region: which accelerator the build has is asked once (it
    # does not change in a process; torch.accelerator's query costs more than a
    # whole CPU stash), whether it is initialised every time (a forked child
    # of an initialised parent is not). Each cache is set by one assignment, so
    # threads racing on the first region at worst both compute it.
    global _ACCELERATOR, _ACCESSES
    if _ACCELERATOR is None:
        _ACCELERATOR = (_accelerator_module(),)
    module = _ACCELERATOR[0]
    if module is None:
        return []
    is_initialized = getattr(module, "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return []
    if _ACCESSES is None:
        _ACCESSES = [_device_access(module, i) for i in range(module.device_count())]
    return _ACCESSES


# The build's accelerator device module (or None), once looked up; its devices'
# accesses, once it was initialised.
_ACCELERATOR: tuple[Any] | None = None
_ACCESSES: list[Access] | None = None


def _accelerator_module() -> Any:
    """The device module of the build's accelerator (``torch.cuda``, ...), or None."""
    api = getattr(torch, "accelerator", None)  # torch >= 2.6; CUDA alone before
    if api is not None:
        accelerator = api.current_accelerator(check_available=True)
        return None if accelerator is None else torch.get_device_module(accelerator.type)
    return torch.cuda if torch.cuda.is_available() else None


def _device_access(module: Any, index: int) -> Access:
    def get_state() -> Tensor:
        return module.get_rng_state(index)

    def set_state(state: Tensor) -> None:
        module.set_rng_state(state, index)

    return get_state, set_state


DEVICE_GENERATORS: Callable[[], list[Access]] = _accelerator_generators

_CPU = torch.default_generator  # the default CPU generator: one object for the process


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs twice as much
class RngStash:
    """The default generators' states when a region's first forward started."""

    cpu: Tensor
    devices: tuple[tuple[Access, Tensor], ...]

    def apply(self, *exc: object) -> None:
        """Set every generator to this state; also a frame's undo, which is given the frame's
        exception (NOTE [ region mechanisms ] in _mechanisms.py)."""
        _CPU.set_state(self.cpu)
        for (_, set_state), state in self.devices:
            set_state(state)

    def current(self) -> RngStash:
        """The same generators' states now, to put back after a recompute."""
        devices = tuple([(access, access[0]()) for access, _ in self.devices])
        return RngStash(_CPU.get_state(), devices)


def stash() -> RngStash:
    """Copy the states of the default CPU and accelerator generators."""
    accesses = DEVICE_GENERATORS()
    devices = tuple([(access, access[0]()) for access in accesses]) if accesses else ()
    return RngStash(_CPU.get_state(), devices)


FRAME_PHASES = frozenset({RECOMPUTE})


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Stash the generators when the region starts, if it replays them."""
    if call.preserve_rng_state:
        tape.rng = stash()
        return True
    return False


def replays(tape: Tape) -> bool:
    """Whether the region replays the default generators (scoped layers align with it)."""
    return tape.rng is not None


def states_now(tape: Tape) -> RngStash | None:
    """The default generators' states now, where the region replays them."""
    return None if tape.rng is None else tape.rng.current()


def kept_bytes(tape: Tape) -> int:
    """The bytes the region's stash keeps until backward (the memory report's)."""
    stashed = tape.rng
    if stashed is None:
        return 0
    return stashed.cpu.nbytes + sum(state.nbytes for _, state in stashed.devices)


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """A recompute starts from the stash; returns what puts the states it found back."""
    stashed = frame.tape.rng
    assert stashed is not None  # start_region said so
    found = stashed.current() if frame.rewind else None
    stashed.apply()
    return None if found is None else found.apply
