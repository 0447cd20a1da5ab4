"""``scopedckpt.memory_report()``: what each region keeps, frees and costs.

NOTE [ memory report ]
======================
A region trades memory for time: instead of the tensors its ops save for
backward it keeps only its inputs (and its tape), and it pays a recompute.
The report measures both sides per region, while a ``memory_report()`` block
is open (in any thread: a recompute runs in backward, possibly elsewhere):

* *freed*: the bytes of the tensors the region's ops saved for backward in its
  first forward, which torch's checkpoint drops and the recompute rebuilds.
  They are seen by wrapping the saved-tensor pack hook torch's checkpoint
  installs around the region (our hook calls torch's, so checkpointing is
  unchanged). Counted once per storage. Not counted, since they stay alive
  anyway: the region's inputs, parameters (and views of them, such as the
  transposed weight a linear layer saves) and, when the region is a module's
  forward, that module's parameters and buffers.
* *kept*: the region's input tensors (once per storage; parameters excluded),
  plus what its tape holds for the recompute: the generators' states of the
  RNG replay, the buffer guard's copies and the op outputs a ``save=`` policy
  keeps (moved from *freed* where the ops also saved them for backward).
* *records*: the scoped-layer decisions on the tape (a dropout seed, a batch
  norm mode: a few bytes each).
* *recompute time*: wall time inside each recompute, from the moment its frame
  is entered to its exit.

A nested region is its own row, and its parent's *freed* also counts what the
nested region's ops saved (they are saved through the parent's hooks).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ..core._oom import explain_outside
from ..core._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape
from ..core._subtree import Listing
from ..core._torch_private import base_of, top_saved_tensors_hooks
from ._rng import kept_bytes
from ._selective import kept_tensors

__all__ = [
    "FRAME_PHASES",
    "MemoryReport",
    "RegionStats",
    "enter_frame",
    "memory_report",
    "start_region",
    "stats_of",
    "text_table",
]

_LOCK = threading.Lock()
_ACTIVE: list[MemoryReport] = []
# The fields of RegionStats a row sums over its region's calls, in a row's key order.
_SUMMED = ("recomputes", "kept_bytes", "freed_bytes", "records", "recompute_seconds", "verified")


@dataclass
class RegionStats:
    """The counts of one region (one first forward and its recomputes)."""

    name: str
    kept_bytes: int = 0
    freed_bytes: int = 0
    records: int = 0
    recomputes: int = 0
    recompute_seconds: float = 0.0
    verified: int = 0  # recomputed tensors compared bit for bit (determinism_check="bitwise")
    _seen: dict[int, Any] = field(default_factory=dict, repr=False)  # see _new_storage_bytes
    _buffers: frozenset[int] = field(default=frozenset(), repr=False)  # the owner's buffer storages
    _freed: dict[int, int] = field(default_factory=dict, repr=False)  # storage -> bytes freed


@dataclass
class MemoryReport:
    """The regions a :func:`memory_report` block saw, one row per region name.

    ``rows`` is a list of JSON-serialisable dicts; ``str(report)`` is a table.
    """

    regions: list[RegionStats] = field(default_factory=list)
    root: Any = None  # the model regions are named in

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One dict per region name (a module's qualified name or a function's name)."""
        rows: dict[str, dict[str, Any]] = {}
        with _LOCK:
            regions = list(self.regions)
        for stats in regions:
            row = rows.setdefault(stats.name, {"region": stats.name, "calls": 0})
            row["calls"] += 1
            for key in _SUMMED:  # first set in a row's first call: keys in _SUMMED's order
                row[key] = row.get(key, 0) + getattr(stats, key)
        return list(rows.values())

    @property
    def totals(self) -> dict[str, Any]:
        """The sums over every row."""
        rows = self.rows
        total: dict[str, Any] = {"region": "total"}
        for key in ("calls", "recomputes", "kept_bytes", "freed_bytes", "records", "verified"):
            total[key] = sum(row[key] for row in rows)
        total["recompute_seconds"] = sum(row["recompute_seconds"] for row in rows)
        return total

    def __str__(self) -> str:
        rows = self.rows
        if not rows:
            return "memory_report: no checkpoint region ran"
        header: tuple[str, ...] = (
            "region", "calls", "recomputes", "kept", "freed", "records", "recompute"
        )  # fmt: skip
        if any(row["verified"] for row in rows):
            header += ("verified",)
        lines = [
            (
                row["region"],
                str(row["calls"]),
                str(row["recomputes"]),
                _size(row["kept_bytes"]),
                _size(row["freed_bytes"]),
                str(row["records"]),
                f"{row['recompute_seconds'] * 1e3:.2f} ms",
                str(row["verified"]),
            )[: len(header)]
            for row in [*rows, self.totals]
        ]
        return "\n".join(text_table(header, lines[:-1], lines[-1]))


def text_table(
    header: tuple[str, ...], rows: Sequence[tuple[str, ...]], total: tuple[str, ...], left: int = 1
) -> list[str]:
    """The lines of a table: its first ``left`` columns aligned left, the others (numbers)
    right, a rule under the header and another above the total row.

    Example
    -------
    >>> for line in text_table(("name", "bytes"), [("a", "1 B")], ("total", "1 B")):
    ...     print(line)
    name   bytes
    -----  -----
    a        1 B
    -----  -----
    total    1 B
    """
    widths = [max(len(r[i]) for r in [header, *rows, total]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        aligned = (
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )
        return "  ".join(aligned).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [line(header), rule, *map(line, rows), rule, line(total)]


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"


@contextmanager
def memory_report(root: torch.nn.Module | None = None) -> Iterator[MemoryReport]:
    """Measure every checkpoint region that starts inside the block.

    Wrap one or more training steps, backward included (recomputes are
    counted when they run). The cost is one Python call per tensor a region's
    ops save; see NOTE [ memory report ] for what each column counts.

    Parameters
    ----------
    root
        The model whose qualified module names name the rows (else the
        ``checkpointing(root=...)`` of the region's scope; else the module's
        class name, so that blocks of one class share a row). Regions made by
        :func:`scopedckpt.checkpoint` are named by the function's name.

    Yields
    ------
    MemoryReport
        Filled in while the block runs; read it after (``str(report)``,
        ``report.rows``, ``report.totals``).

    Example
    -------
    >>> import torch, scopedckpt
    >>> block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
    >>> model = torch.nn.Sequential(block, torch.nn.Linear(64, 1))
    >>> x = torch.randn(32, 64, requires_grad=True)
    >>> with scopedckpt.memory_report(root=model) as report:
    ...     with scopedckpt.checkpointing(model[0]):
    ...         loss = model(x).sum()
    ...     loss.backward()
    >>> [(row["region"], row["calls"], row["recomputes"]) for row in report.rows]
    [('0', 1, 1)]
    >>> report.rows[0]["freed_bytes"]   # the Linear output GELU saved: 32 x 64 floats
    8192
    """
    report = MemoryReport(root=root)
    with _LOCK:
        _ACTIVE.append(report)
    try:
        yield report
    except torch.OutOfMemoryError as error:
        so_far = f"The regions it measured so far:\n{report}" if report.rows else ""
        modules = [] if root is None else [root]
        explain_outside(error, "a memory_report() block", modules, so_far)
        raise
    finally:
        with _LOCK:
            _ACTIVE.remove(report)


def _buffer_storages(listing: Listing) -> frozenset[int]:
    """The storages of every buffer (and parameter) registered in a module's subtree."""
    return frozenset(
        t.untyped_storage().data_ptr()
        for registered in listing.registrations
        for t in registered.values()
        if t is not None and t.layout is torch.strided and not is_lazy(t)
    )


def _name(owner: object | None, label: object, root: Any) -> str:
    """A module's qualified name in ``root`` (else its class name), or a function's name."""
    if owner is not None:
        if root is not None:
            for name, module in root.named_modules():
                if module is owner:
                    return name or "<root>"
        return type(owner).__name__
    name = getattr(label, "__qualname__", None) or getattr(label, "__name__", None)
    return str(name) if name else type(label).__name__


def _new_storage_bytes(seen: dict[int, Any], tensor: torch.Tensor) -> int:
    """``tensor``'s storage size if ``seen`` has not counted that storage yet.

    Storages are keyed by address and forgotten when they are freed: inside a
    region saved tensors are not kept alive, so a later tensor may reuse the
    address of a freed one, and must count as new.
    """
    if tensor.layout is not torch.strided or tensor.device.type == "meta":
        return 0
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key in seen or key == 0:
        return 0
    seen[key] = weakref.ref(storage, functools.partial(_forget, seen, key))
    return storage.nbytes()


def _forget(seen: dict[int, Any], key: int, _: object) -> None:
    seen.pop(key, None)


def counting_saved_tensors(stats: RegionStats) -> Callable[..., None] | None:
    """Count the tensors a region's first forward saves, then hand them to torch's hook;
    returns what stops counting (None outside torch's checkpoint: nothing to count)."""
    top = top_saved_tensors_hooks()
    if top is None:
        return None
    pack, unpack = top
    seen, buffers, freed = stats._seen, stats._buffers, stats._freed
    parameter, plain = torch.nn.Parameter, torch.Tensor

    def counting_pack(tensor: torch.Tensor) -> Any:
        # Runs for every saved tensor: the common case (seen, or a weight)
        # returns before any call.
        base = base_of(tensor)
        owner = tensor if base is None else base  # a weight, or its transpose
        # isinstance(x, Parameter) runs Python (Parameter's metaclass) for
        # every plain tensor: tell those apart by type first.
        kind = type(owner)
        if kind is not parameter and (kind is plain or not isinstance(owner, parameter)):
            key = tensor.untyped_storage().data_ptr()
            if key not in seen and key not in buffers:
                counted = _new_storage_bytes(seen, tensor)
                stats.freed_bytes += counted
                freed[key] = counted
        return pack(tensor)

    hooks = torch.autograd.graph.saved_tensors_hooks(counting_pack, unpack)
    hooks.__enter__()
    return hooks.__exit__


def finish_forward(stats: RegionStats, tape: Tape) -> None:
    """The first forward ended: add what the tape keeps."""
    stats.records = len(tape.records)
    stats.kept_bytes += kept_bytes(tape)  # the RNG stash; the guard's copies counted as taken
    for tensor in kept_tensors(tape):  # outputs kept by save= (NOTE [ selective saving ])
        key = tensor.untyped_storage().data_ptr()
        counted = stats._freed.pop(key, None)
        if counted is not None and key in stats._seen:
            # Saved for backward and kept on the tape: not freed after all.
            stats.freed_bytes -= counted
            stats.kept_bytes += counted
        else:
            stats.kept_bytes += _new_storage_bytes(stats._seen, tensor)


def recomputed(stats: RegionStats, seconds: float) -> None:
    stats.recomputes += 1
    stats.recompute_seconds += seconds


now = time.perf_counter

FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})


def stats_of(tape: Tape) -> RegionStats | None:
    """The region's row while a ``memory_report()`` block measures it, else None."""
    return tape.stats


def start_region(tape: Tape, call: RegionCall) -> bool:
    """A region starts: its row, if a report is open."""
    if not _ACTIVE:
        return False
    owner, label = call.owner, call.label
    stats = RegionStats(_name(owner, label, call.scope.root or _ACTIVE[-1].root))
    for _, tensor, _ in call.tensors:  # its tensor arguments, positional then keyword
        if not isinstance(tensor, torch.nn.Parameter):
            stats.kept_bytes += _new_storage_bytes(stats._seen, tensor)
    if call.listing is not None:
        # The module's buffers stay alive whatever the region saves (parameters too: the
        # pack hook tells them by type). A plain set: these live longer than the report,
        # so they need no weak references (which cost more than the rest of this
        # function on small blocks).
        stats._buffers = _buffer_storages(call.listing)
    with _LOCK:
        for report in _ACTIVE:
            report.regions.append(stats)
    tape.stats = stats
    return True


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """Count what a first forward saves, time a recompute; returns what records it."""
    stats = frame.tape.stats
    assert stats is not None  # start_region said so
    if frame.phase is FORWARD:
        stop_counting = counting_saved_tensors(stats)

        def finish(*exc: object) -> None:
            if stop_counting is not None:
                stop_counting(*exc)
            finish_forward(stats, frame.tape)

        return finish
    began = now()

    def timed(*exc: object) -> None:
        recomputed(stats, now() - began)

    return timed
