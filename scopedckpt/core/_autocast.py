"""The autocast state a checkpoint's recompute runs under: the first forward's, recorded
as torch's checkpoint records it, and entered again."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.checkpoint import DefaultDeviceType

from . import _torch_private
from ._contexts import Both

__all__ = ["autocast_as", "autocast_state", "device_type"]


def device_type(args: tuple[Any, ...]) -> str:
    """The device type torch's checkpoint infers from a region's arguments (the first
    non-CPU one, CUDA first; else torch's default), without flattening plain tensors."""
    found = None
    for arg in args:
        if isinstance(arg, list | tuple | dict):
            return _torch_private.infer_device_type(*args)
        if isinstance(arg, torch.Tensor):
            kind = arg.device.type
            if kind == "cuda":
                return kind
            if kind != "cpu" and found is None:
                found = kind
    return found or str(DefaultDeviceType.get_device_type())


def autocast_as(state: tuple[Any, ...]) -> Any:
    """Enter the autocast state ``state`` (from :func:`autocast_state`) where it is not
    the state now: as torch's recompute does, the device's, then the CPU's."""
    if state == autocast_state(state[0]):
        return _NOTHING
    device_type, device_kwargs, cpu_kwargs = state
    device = (
        _NOTHING
        if device_kwargs is None
        else torch.amp.autocast(device_type=device_type, **dict(device_kwargs))
    )
    return Both(device, torch.amp.autocast("cpu", **dict(cpu_kwargs)))


_NOTHING = contextlib.nullcontext()  # re-enterable


def autocast_state(device_type: str) -> tuple[Any, ...]:
    """The autocast keywords torch's checkpoint records (``_get_autocast_kwargs``)."""
    cache = torch.is_autocast_cache_enabled()
    device = _keywords(device_type, cache) if torch.amp.is_autocast_available(device_type) else None
    return (device_type, device, _keywords("cpu", cache))


def _keywords(device_type: str, cache: bool) -> tuple[tuple[str, Any], ...]:
    return (
        ("enabled", torch.is_autocast_enabled(device_type)),
        ("dtype", torch.get_autocast_dtype(device_type)),
        ("cache_enabled", cache),
    )
