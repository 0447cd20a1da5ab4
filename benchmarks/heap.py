"""Peak heap bytes in use during a step: glibc's mallinfo2, sampled after every aten op.

RSS peaks mislead on CPU: glibc's dynamic mmap threshold moves after large frees,
so the same program keeps more or fewer freed pages resident from one run to the
next. ``mallinfo2`` reports the bytes malloc has handed out and not got back
(``uordblks``, in arenas, plus ``hblkhd``, in mmapped chunks), which is what the
tensors use. A ``TorchDispatchMode`` samples it after every aten op of the forward
and the backward (CPU autograd runs on the calling thread), so the peak is seen
at op granularity. Linux with glibc only.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo2


def in_use() -> int:
    """Bytes malloc has handed out and not got back, now."""
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _Sampler(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.peak = in_use()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        used = in_use()
        if used > self.peak:
            self.peak = used
        return out


def peak_in_use(step: Callable[[], None]) -> int:
    """The most heap bytes in use at any op boundary of ``step()``, above those before it."""
    before = in_use()
    with _Sampler() as sampler:
        step()
    return max(sampler.peak, in_use()) - before


def sampling_overhead(step: Callable[[], None], repeats: int) -> float:
    """Median step time with the sampler over without (the price of the measurement)."""
    plain, sampled = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        peak_in_use(step)
        sampled.append(time.perf_counter() - start)
    plain.sort()
    sampled.sort()
    return sampled[len(sampled) // 2] / plain[len(plain) // 2]
