"""Live tensor bytes of a training step, counted below autograd: every storage an op
creates, from its creation until it is freed, with the block that created it.

NOTE [ live bytes ]
===================
The planner's unit of memory is what ``torch.cuda.max_memory_allocated`` shows
minus what was allocated before the step, on any device, CPU included (where
the process's resident size says little: glibc serves large blocks by ``mmap``
and keeps freed small ones). :class:`LiveBytes` is a dispatch mode that sees
every aten op below autograd, the backward's and the recompute's included (on
CPU, where backward runs on the calling thread: tested; a CUDA backward runs on
autograd's device threads, which ``at::ThreadLocalState`` says take the calling
thread's dispatch modes: read in torch's source, not yet measured here), and
counts each new storage an op returns by its ``nbytes`` until the storage is
freed: torch keeps one Python object per live storage, so a weak reference to
it dies exactly when the storage does. Views
and in-place results (ops whose schema returns an alias of an argument) share
their argument's storage and add nothing (a view of a parameter is the
parameter), except that an op writing into a counted tensor may have enlarged
its storage (``out=`` ops, ``resize_``), which counts the growth. What no op
creates (tensors made before the mode, parameters, the allocator's rounding
and caching) is not counted: it is the model's resting state, or the
allocator's business.

Each storage is charged to the block whose forward created it (``tag``), so
what a block keeps for backward is the bytes of its storages still alive when
the forward ends: an additive split, since a storage has one creator.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..core._torch_private import TorchDispatchMode, op_schema_facts

__all__ = ["OUTSIDE", "LiveBytes", "tensors"]

OUTSIDE = -1  # the tag of storages created outside every block


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``: a tensor, or nested tuples, lists and dicts of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has a storage of its own bytes (strided, not on meta)."""
    return tensor.layout is torch.strided and tensor.device.type != "meta"


def storages(value: Any) -> Iterator[torch.UntypedStorage]:
    """The storages of the dense tensors in ``value`` (an op's output: :func:`tensors`)."""
    for tensor in tensors(value):
        if _dense(tensor):
            yield tensor.untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Count the bytes of the storages ops create, live and at their peak.

    Attributes
    ----------
    live
        Bytes of the counted storages alive now.
    peak
        The most ``live`` has been since the last :meth:`restart_peak`.
    tag
        The creator charged for the storages made from now on.
    by_tag
        Live bytes per creator.

    Example
    -------
    >>> import torch
    >>> with LiveBytes() as counter:
    ...     y = torch.ones(256).exp()      # ones: 1 KiB, exp: 1 KiB
    ...     del y
    >>> counter.live, counter.peak
    (0, 2048)
    """

    def __init__(
        self,
        observe: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None] | None = None,
        before: Callable[[Any, tuple[Any, ...], dict[str, Any]], None] | None = None,
        freed: Callable[[int, int], None] | None = None,
        grown: Callable[[int, int, bool], None] | None = None,
    ) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.ops = 0  # ops seen
        self.tag = OUTSIDE
        self.by_tag: dict[int, int] = {}
        self.observe = observe  # called (func, args, kwargs, output) after every op
        self.before = before  # called (func, args, kwargs) before every op
        self.freed = freed  # called (serial, bytes) when a counted storage is freed
        # called (serial, bytes, new) when an op made a counted storage or grew one, before
        # ``observe``
        self.grown = grown
        self._lock = threading.Lock()
        self._serial = 0
        self._aliasing: dict[Any, bool] = {}  # op -> whether it returns an argument's alias
        # id(storage object) -> (weak reference, bytes counted, creator's tag, serial)
        self._counted: dict[int, tuple[weakref.ref[Any], int, int, int]] = {}

    def restart_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak = self.live

    def counted(self, value: Any) -> Iterator[tuple[int, int, int]]:
        """(bytes, creator's tag, serial) of each counted storage of ``value``; a serial is
        a number no other counted storage had or will have (ids are reused)."""
        for storage in storages(value):
            entry = self._counted.get(id(storage))
            if entry is not None:
                yield entry[1:]

    def alive(self) -> set[int]:
        """The serials of the counted storages alive now."""
        with self._lock:
            return {entry[3] for entry in self._counted.values()}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if self.before is not None:
            self.before(func, args, kwargs)
        out = func(*args, **kwargs)
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            aliasing = self._aliasing[func] = op_schema_facts(func)[1]
        # A view or an in-place result is its argument's storage: nothing new.
        if type(out) is torch.Tensor:  # most ops: no walk through containers
            if _dense(out):
                self._count(out.untyped_storage(), new=not aliasing)
        else:
            for storage in storages(out):
                self._count(storage, new=not aliasing)
        if self.observe is not None:
            self.observe(func, args, kwargs, out)
        return out

    def _count(self, storage: torch.UntypedStorage, new: bool) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            entry = self._counted.get(key)
            if entry is None and not new:
                return
            if entry is not None:
                grown, tag = nbytes - entry[1], entry[2]  # resized in place (out= ops, resize_)
                if grown <= 0:
                    return
                serial = entry[3]
                self._counted[key] = (entry[0], nbytes, tag, serial)
            else:
                grown, tag = nbytes, self.tag
                ref = weakref.ref(storage, self._freed_callback(key))
                self._serial += 1
                serial = self._serial
                self._counted[key] = (ref, nbytes, tag, serial)
            self.live += grown
            self.by_tag[tag] = self.by_tag.get(tag, 0) + grown
            if self.live > self.peak:
                self.peak = self.live
        if self.grown is not None:
            self.grown(serial, grown, entry is None)

    def _freed_callback(self, key: int) -> Callable[[Any], None]:
        # A weak reference to self: a storage outliving the counter must not keep it.
        me = weakref.ref(self)

        def freed(_: object) -> None:
            counter = me()
            if counter is None:
                return
            with counter._lock:
                entry = counter._counted.pop(key, None)
                if entry is not None:
                    counter.live -= entry[1]
                    counter.by_tag[entry[2]] -= entry[1]
            if entry is not None and counter.freed is not None:
                counter.freed(entry[3], entry[1])

        return freed
