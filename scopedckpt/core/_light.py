"""The light check: every region call that is not verified bit for bit still compares one
saved tensor of its recompute with its first forward's, and a recompute that takes another
path is named.

NOTE [ light check ]
====================
Sampled verification (NOTE [ sampled verification ]) compares every saved
tensor, on a few calls. Between them, each call of an eager region under the
default determinism check compares one: its *tail*, the last tensor the first
forward saves that the region computed (it has an autograd node and is not a
view of a leaf: not a parameter, not noise, not a batch norm's statistics).
The tail depends on everything before it in the region: weights, random
numbers, attributes, arguments. So a recompute that runs with other weights
(``torch.func.functional_call`` has put the module's own back), draws other
random numbers (Python's ``random``) or reads a changed attribute is seen on
the call where it happens, not at the next sampled one.

* The tail's index is learned per site (:class:`_sampling.Site`), on the
  site's first call that is not light-checked; from then on the first forward
  fingerprints the tensor at that index when it saves it (the sum of its bit
  patterns, one reduction over one tensor), and each tensor past it
  that could be a tail (a call that saves more than the one the site learned
  from, a branch taken after warm-up), and the recompute fingerprints its own
  at the same indices when it collects them, both before any later op could
  write them. Nothing is held: a light-checked call keeps no tensor alive that
  an unchecked one would free.
* A call that saves no tensor at the tail's index (a shorter path) has nothing
  to compare there; the count check below names it.
* The recompute must save as many tensors as the first forward did: where it
  saves more or fewer, it took another path (Python's ``random`` or a warm-up
  switch in control flow, data changed since). :class:`RecomputeDivergenceError`
  names the region by its path and these causes; it is a ``CheckpointError``
  too, which is what torch's checkpoint raises there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointError

from ._errors import ScopedCkptError
from ._torch_private import base_of

__all__ = ["RecomputeDivergenceError", "diverged", "fingerprint", "is_tail", "other_values"]

_CAUSES = (
    "Likely causes: state the region reads outside its modules' tensors and attributes (a "
    "global, an object that is not a module, a list) that changed between forward and "
    "backward; an attribute, a generator or Python's random first used on a call that was "
    "not verified (a warm-up switch: the world is learned on verified calls); data written "
    'in place between forward and backward. determinism_check="bitwise" names the first '
    "differing op and its source line; scopedckpt.testing.assert_checkpoint_equivalent("
    "model, *inputs) compares whole steps."
)


class RecomputeDivergenceError(ScopedCkptError, CheckpointError):
    """A region's recompute did not reproduce its first forward (NOTE [ light check ])."""


def is_tail(x: Tensor) -> bool:
    """Whether ``x`` can be a region's tail: computed in the region, not a leaf's view."""
    if x.grad_fn is None:
        return False
    base = base_of(x)
    return base is None or base.grad_fn is not None


_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(x: Tensor) -> Tensor:
    """The tail's fingerprint: the sum of its bit patterns (its elements viewed as integers
    of their own size): one reduction, which any changed element changes. It wraps modulo
    2**32 (2**64 for 8-byte elements): int32 accumulates faster than int64 on CPU, and one
    element's bits change by less than 2**32."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    size = x.element_size()
    return x.view(_INTEGERS[size]).sum(dtype=torch.int64 if size == 8 else torch.int32)


def name_or(name: Callable[[], str] | None) -> str:
    """The region's name for a message, or a generic one."""
    return name() if name is not None else "a checkpoint region"


def other_values(
    name: Callable[[], str] | None, index: int, x: Tensor | None
) -> RecomputeDivergenceError:
    """The error for a tail whose recomputed fingerprint differs."""
    made = ""
    if x is not None and x.grad_fn is not None:
        made = f", the output of {type(x.grad_fn).__name__.removesuffix('Backward0')}"
    return RecomputeDivergenceError(
        f"scopedckpt: the recompute of {name_or(name)} did not reproduce its first forward; "
        'determinism_check="bitwise" names the op.\n'
        f"Saved tensor #{index}{made} has other values. {_CAUSES}"
    )


def diverged(
    name: Callable[[], str] | None, forward: int, recompute: str
) -> RecomputeDivergenceError:
    """The error for a recompute that saved another number of tensors."""
    return RecomputeDivergenceError(
        f"scopedckpt: the recompute of {name_or(name)} took another path than its first "
        "forward; keep data-dependent branches out of the region.\n"
        f"The forward saved {forward} tensors for backward, the recompute {recompute}. "
        f"{_CAUSES}"
    )
