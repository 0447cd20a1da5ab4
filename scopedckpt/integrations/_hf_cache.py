"""Hugging Face key/value caches refused in regions: a region mechanism.

Registered by :mod:`scopedckpt.integrations` (NOTE [ region mechanisms ] in
``_mechanisms.py``): when a region starts, a ``transformers`` cache among its
arguments raises :class:`ScopedCkptError`, since every recompute would append
this step's keys and values to it again. Layers declaring
``_can_checkpoint_with_cache = True`` only read the cache (Hugging Face keeps
it for them under its own checkpointing): allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core._errors import ScopedCkptError
from ..core._state import Frame, Phase, RegionCall, Tape, region_name

__all__ = ["FRAME_PHASES", "enter_frame", "start_region"]


FRAME_PHASES: frozenset[Phase] = frozenset()  # it never acts in frames


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Refuse a Hugging Face cache among the region's arguments; nothing to do in frames."""
    # Runs at every region start: only non-tensor arguments are looked at, the layer's opt-out is
    # looked up (a failing nn.Module attribute lookup is slow) and names are
    # formatted only when a cache is there.
    for key, value in call.others:
        kind = type(value)
        if kind.__name__.endswith("Cache") and kind.__module__.startswith("transformers."):
            layer = call.owner if call.owner is not None else call.label
            if getattr(layer, "_can_checkpoint_with_cache", False) is True:
                return False
            if isinstance(key, int):
                name = f"positional argument #{key}"
            else:
                name = f"keyword argument {key!r}"
            raise ScopedCkptError(
                f"scopedckpt: {region_name(call)} got a Hugging Face {kind.__name__} as "
                f"{name} in a region: pass use_cache=False while training.\n"
                "The recompute in backward would append this step's keys and values to the "
                "cache a second time, and the region would see a longer cache than its first "
                "forward. Pass use_cache=False while training with checkpointing (Hugging "
                "Face's own gradient checkpointing does the same), or use "
                "scopedckpt.integrations.huggingface.gradient_checkpointing_enable(model)."
            )
    return False


def enter_frame(frame: Frame) -> Callable[..., Any] | None:
    """Nothing to do in a frame."""
    return None
