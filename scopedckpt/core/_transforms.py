"""Regions under a torch.func transform run plainly, said once.

NOTE [ torch.func transforms ]
==============================
Under ``torch.func.vmap``, ``grad``, ``vjp``, ``jacrev`` and the rest, a region's
saved tensors are the transform's wrapped tensors and its parameters may be the
transform's (``vmap(functional_call(model, stacked_params, x))`` over an
ensemble built with ``torch.func.stack_module_state``). A recompute runs in
backward, outside the transform, and cannot see either: torch's checkpoint
fails there with a ``CheckpointError`` or an error about saved-tensor hooks.
So a region that starts under a transform runs its function plainly: exact,
without saving memory. A ``UserWarning`` says so once per process.
"""

from __future__ import annotations

import warnings

from . import _torch_private

__all__ = ["under_transform"]


class _Said:
    transform = False  # the warning, given once per process


def under_transform() -> bool:
    """Whether a torch.func transform runs now; the first time, warn that regions run
    plainly there.

    Example
    -------
    >>> under_transform()
    False
    """
    if _torch_private.functorch_level() is None:
        return False
    if not _Said.transform:
        _Said.transform = True
        warnings.warn(
            "scopedckpt: a checkpoint region runs under a torch.func transform (vmap, grad, "
            "vjp, jacrev, ...), where a recompute in backward would run outside the "
            "transform: such regions run plainly, without checkpointing (exact, with no "
            "memory saved). Checkpoint inside the transformed function with "
            "torch.utils.checkpoint if you need the memory. Said once per process.",
            UserWarning,
            stacklevel=4,
        )
    return True
