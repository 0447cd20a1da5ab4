"""``scopedckpt.peak_report()``: which tensors make up a training step's peak memory, and the
moment (phase, region, op, source line) it is reached, in the planner's unit of live bytes.

NOTE [ peak attribution ]
=========================
A :class:`LiveBytes` counter (NOTE [ live bytes ] in ``_live.py``) runs the step once and a
recorder watches it. Before each op it notes the *moment*: the innermost region frame's
phase and owner (``FRAME``: a recompute runs inside the backward but under its region's
``RECOMPUTE`` frame), else the optimizer step (between its step hooks), else the backward
while autograd runs a graph task, else the forward. After each op it notes each storage the
op made or grew, with the moment and whether scopedckpt's own bookkeeping made it; and each
counted storage freed. Invariant: every change of the counter's ``live`` is one event, in
order, so replaying the events up to the first op after which ``live`` was at its maximum
gives exactly the storages live at the peak: the categories sum to :func:`measure_peak`'s
peak. A storage's category, first match wins: a ``.grad`` of ``root``'s or ``optimizer``'s
parameters (a post-accumulate-grad hook marks it), a tensor of ``optimizer.state`` when the
step ends, scopedckpt's own ops (verification fingerprints, copies), else the moment that
made it. What outlives a region's forward is what the region keeps (its output, what
``save=`` keeps); what outlives the forward outside regions is what autograd saved there,
and the regions' inputs. Only serials and sizes are kept, never a tensor, so the step frees
what it would and trains bit for bit the same. What existed before the step (parameters,
buffers, existing gradients and optimizer state, inputs) is resting state, reported apart.
"""

from __future__ import annotations

import os
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core._names import LIBRARY_SOURCES, frame_region_name, innermost_user_frame
from ..core._oom import add_hint
from ..core._own_ops import issuing_own_ops
from ..core._state import FRAME, RECOMPUTE
from ..core._torch_private import graph_task_key
from ..mechanisms._report import text_table
from ._budget import format_bytes
from ._live import LiveBytes, storages
from ._timeline import page

__all__ = ["PeakReport", "peak_report", "remember"]

Moment = tuple[str, str | None]  # (phase, region)


def _line(frame: types.FrameType | None, line: int | None = None) -> str | None:
    """The innermost source line outside ``LIBRARY_SOURCES`` from ``frame`` out (the given
    line, or each frame's current one), or None."""
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(LIBRARY_SOURCES):
            return f"{code.co_filename}:{line or frame.f_lineno} (in {code.co_name})"
        frame = None if line else frame.f_back
    return None


def _where(phase: str, region: str | None) -> str:
    if region is None:
        return "forward outside regions" if phase == "forward" else phase
    return f"{phase} of {region if ' ' in region else 'region ' + region}"


@dataclass(frozen=True)
class PeakReport:
    """What was live at a step's peak, by category, and the moment it was reached.

    ``peak`` is in bytes, :func:`scopedckpt.measure_peak`'s unit, and ``live`` (bytes by
    category, largest first) sums to it. ``phase`` is ``"forward"``, ``"backward"``,
    ``"recompute"`` or ``"optimizer step"``; ``region`` the region in flight (its module
    path in ``root``, else its description) or None; ``op``, ``source`` and ``op_index``
    the aten op after which the peak was reached, the innermost line outside torch and
    scopedckpt running it, and its index. ``resting``: bytes that existed before the step,
    not in the peak. ``timeline``: live bytes after each op; ``phases``: (first op, phase,
    region) of each stretch of one moment.
    """

    peak: int
    phase: str
    region: str | None
    op: str
    source: str
    op_index: int
    live: dict[str, int]
    resting: dict[str, int]
    timeline: tuple[int, ...] = field(repr=False)
    phases: tuple[tuple[int, str, str | None], ...] = field(repr=False)

    @property
    def where(self) -> str:
        """The moment in words: ``recompute of region blocks.1``."""
        return _where(self.phase, self.region)

    def __str__(self) -> str:
        return (
            f"peak {format_bytes(self.peak)} at op {self.op_index} of {len(self.timeline)}, "
            f"in the {self.where}\n  {self.op} at {self.source}\n\n{self.table('at the peak')}"
        )

    def table(self, when: str) -> str:
        """The categories' table: what was live ``when``, in bytes and shares of the total."""
        share = max(self.peak, 1)
        rows = [(k, format_bytes(n), f"{n / share:.0%}") for k, n in self.live.items()]
        head, total = (f"live {when}", "bytes", "share"), ("total", format_bytes(self.peak), "100%")
        lines = text_table(head, rows, total)
        resting = ", ".join(f"{k} {format_bytes(n)}" for k, n in self.resting.items())
        return "\n".join([*lines, f"not counted (resting before the step): {resting or 'none'}"])

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data (the timeline left out: see ``timeline``)."""
        names = ("peak", "phase", "region", "op", "source", "op_index", "live", "resting")
        data = {name: getattr(self, name) for name in names}
        return {**data, "ops": len(self.timeline), "phases": [list(p) for p in self.phases]}

    def save_html(self, path: str | os.PathLike[str]) -> None:
        """Write the step's memory timeline, phases shaded and the peak marked, as one
        self-contained HTML page (inline SVG, no script or network) with this table."""
        with open(path, "w", encoding="utf-8") as file:
            file.write(page(self.timeline, self.phases, self.op_index, str(self)))


class _Recorder:
    """Watches one step through a :class:`LiveBytes` counter (NOTE [ peak attribution ])."""

    def __init__(self, root: nn.Module | None, limit: int | None) -> None:
        self.counter = LiveBytes(
            observe=self.observe, before=self.before, freed=self.freed, grown=self.grown
        )
        self.paths = {} if root is None else {id(m): p for p, m in root.named_modules()}
        self.limit, self.stepping = limit, False  # stepping: inside the optimizer's step
        self.moments: dict[Any, Moment] = {}  # a frame's (phase, owner id), or a phase
        self.now: tuple[Moment, bool, Any] = (("forward", None), False, "")  # moment, own, op
        self.key: Any = None  # the moments' key of the latest op (its moment: now[0])
        self.made: dict[int, tuple[Moment, bool]] = {}  # serial -> (moment, own) that made it
        self.sizes: dict[int, int] = {}  # serial -> bytes, of counted storages live now
        self.events: list[tuple[int, int]] = []  # (serial, bytes made or grown; - freed)
        self.timeline: list[int] = []  # the counter's live after each op
        self.phases: list[tuple[int, str, str | None]] = []
        self.marked: dict[int, str] = {}  # serial -> gradients / optimizer state
        self.best: tuple[int, int, int, Moment, Any, str] = (-1, 0, 0, self.now[0], "", "")
        # The op in flight (events before it, its index, now), whether it has not returned
        # yet (it raised, if another op starts), and the latest op that raised.
        self.inflight: tuple[int, int, tuple[Moment, bool, Any]] = (0, 0, self.now)
        self.raised: tuple[int, int, tuple[Moment, bool, Any]] = self.inflight
        self.pending = False

    def before(self, func: Any, args: Any, kwargs: Any) -> None:
        frame = FRAME.get()
        if frame is None:
            key: Any = "optimizer step" if self.stepping else type(graph_task_key()) is not object
        else:
            key = (frame.phase, id(frame.owner))
        moment = self.now[0]
        if key != self.key:  # the moment changed (or is seen for the first time)
            self.key = key
            found = self.moments.get(key)
            if found is None:
                if frame is None:
                    found = (key if self.stepping else "backward" if key else "forward", None)
                else:
                    region = self.paths.get(id(frame.owner)) or frame_region_name(frame)
                    found = ("recompute" if frame.phase is RECOMPUTE else "forward", region)
                self.moments[key] = found
            if found != moment or not self.phases:
                self.phases.append((len(self.timeline), *found))
            moment = found
        if self.pending:  # the op before raised: the ops after it (clean-up) must not hide it
            self.raised = self.inflight
        self.now = (moment, issuing_own_ops(), func)  # named in the report only
        self.inflight, self.pending = (len(self.events), len(self.timeline), self.now), True

    def grown(self, serial: int, nbytes: int, new: bool) -> None:
        if new:
            self.made[serial] = self.now[:2]
        self.sizes[serial] = self.sizes.get(serial, 0) + nbytes
        self.events.append((serial, nbytes))

    def observe(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        self.pending = False
        live, at = self.counter.live, len(self.timeline)
        self.timeline.append(live)
        if live > self.best[0]:
            source = _line(sys._getframe(1)) or "an unknown line"
            self.best = (live, len(self.events), at, self.now[0], self.now[2], source)
        if self.limit is not None and live > self.limit:
            self.inflight, self.pending = (len(self.events), at, self.now), True
            limit, self.limit = self.limit, None  # once: the clean-up's ops must not raise
            raise torch.OutOfMemoryError(
                f"scopedckpt: simulated out of memory: {live} bytes live would exceed "
                f"peak_report(limit={limit})."
            )

    def freed(self, serial: int, nbytes: int) -> None:
        if self.sizes.pop(serial, None) is not None:
            self.events.append((serial, -nbytes))

    def grad_made(self, parameter: torch.Tensor) -> None:
        self.mark([parameter.grad], "gradients")

    def stepping_on(self, *_: Any) -> None:
        self.stepping = True

    def stepping_off(self, *_: Any) -> None:
        self.stepping = False

    def mark(self, values: Iterable[Any], category: str) -> None:
        for value in values:
            for _, _, serial in self.counter.counted(value):
                self.marked.setdefault(serial, category)

    def report(self, resting: dict[str, int], failed_at: str | None = None) -> PeakReport:
        """The report at the peak, or, given the failing line, at the op that raised."""
        _, events, at, moment, op, source = self.best
        if failed_at is not None:
            events, at, (moment, _, op) = self.inflight if self.pending else self.raised
            source = failed_at
        sizes: dict[int, int] = {}
        for serial, change in self.events[:events]:
            sizes[serial] = sizes.get(serial, 0) + change
        live: dict[str, int] = {}
        for serial, nbytes in sizes.items():
            made, own = self.made[serial]
            name = self.marked.get(serial) or ("scopedckpt's own ops" if own else _where(*made))
            live[name] = live.get(name, 0) + nbytes
        live = dict(sorted(((k, n) for k, n in live.items() if n), key=lambda i: (-i[1], i[0])))
        return PeakReport(
            sum(live.values()), *moment, str(op), source, at, live, resting,
            tuple(self.timeline), tuple(self.phases),
        )  # fmt: skip


def _bytes(values: Iterable[Any]) -> int:
    """The bytes of the distinct storages of ``values``."""
    return sum({s.data_ptr(): s.nbytes() for v in values for s in storages(v)}.values())


def peak_report(
    step: Callable[..., Any],
    *args: Any,
    root: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    limit: int | None = None,
    **kwargs: Any,
) -> PeakReport:
    """Run ``step(*args, **kwargs)`` once and say what its peak memory is made of, and when.

    The peak is :func:`scopedckpt.measure_peak`'s (the bytes of the tensors the step's ops
    create, above what existed before it). The report splits it into gradients, optimizer
    state, what each region's forward and the forward outside regions left alive, each
    region's recompute, the backward, the optimizer step and scopedckpt's own ops (NOTE
    [ peak attribution ] in ``scopedckpt/planner/_peak.py``), and names the phase, region,
    op and source line at the peak. The step trains bit for bit as it would without it.
    A ``torch.OutOfMemoryError`` inside the step is raised again, chained, with the
    attribution at the failing op and the region in flight in its message.

    Parameters
    ----------
    step
        A training step: a callable running the forward and the backward (and, if you
        like, the optimizer step), as for :func:`scopedckpt.measure_peak`.
    *args, **kwargs
        Passed to ``step``.
    root
        The model: names regions by module path, and tells its gradients apart.
    optimizer
        The optimizer ``step`` steps: tells its step and the state it creates apart.
    limit
        Bytes: simulate running out of memory, raising ``torch.OutOfMemoryError`` after
        the first op that brings the step's live bytes above ``limit``.

    Returns
    -------
    PeakReport
        ``print(report)`` prints a table; ``report.to_dict()``; ``report.save_html(path)``.

    Example
    -------
    >>> import torch, scopedckpt
    >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
    ...                             torch.nn.Linear(256, 1))
    >>> x = torch.randn(64, 256)
    >>> report = scopedckpt.peak_report(lambda: model(x).sum().backward(), root=model)
    >>> report.phase, report.op
    ('backward', 'aten.sum.dim_IntList')
    >>> report.live   # bytes: the gradients, a backward temporary, the loss
    {'gradients': 264196, 'backward': 65536, 'forward outside regions': 8}
    >>> sum(report.live.values()) == report.peak
    True
    """
    if not callable(step):
        raise TypeError(
            f"scopedckpt: peak_report() takes the step to run, a callable, and got "
            f"{type(step).__name__}. Pass a function that runs the forward and the "
            "backward, e.g. peak_report(lambda: model(x).sum().backward(), root=model)."
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"scopedckpt: peak_report(limit={limit!r}) takes bytes, an int >= 0.")
    params = {id(p): p for p in (root.parameters() if root is not None else ())}
    for group in optimizer.param_groups if optimizer is not None else ():
        params.update((id(p), p) for p in group["params"])
    state = optimizer.state.values() if optimizer is not None else ()
    resting = {
        "parameters and buffers": _bytes([*params.values(), *(root.buffers() if root else ())]),
        "gradients": _bytes(p.grad for p in params.values()),
        "optimizer state": _bytes(state),
    }
    resting = {name: n for name, n in resting.items() if n}
    recorder = _Recorder(root, limit)
    grads = [p for p in params.values() if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(recorder.grad_made) for p in grads]
    if optimizer is not None:
        handles.append(optimizer.register_step_pre_hook(recorder.stepping_on))
        handles.append(optimizer.register_step_post_hook(recorder.stepping_off))
    try:
        with recorder.counter:
            step(*args, **kwargs)
    except torch.OutOfMemoryError as error:
        found = innermost_user_frame(error.__traceback__)
        report = recorder.report(resting, _line(*found) if found else "an unknown line")
        raise torch.OutOfMemoryError(
            f"scopedckpt: out of memory in the {report.where}, at {report.op} "
            f"({report.source}), with {format_bytes(report.peak)} live in the step; checkpoint "
            "what the largest rows made, or let scopedckpt.plan(model, x, budget=...) choose.\n"
            f"{report.table('when it failed')}\nThe error: {error}"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
        recorder.counter.freed = None  # storages the step returns are freed after it
    recorder.mark((p.grad for p in params.values()), "gradients")
    recorder.mark(state, "optimizer state")
    return recorder.report(resting)


# The latest plan of each planned block's module, weakly both ways, for out-of-memory notes.
_PROFILED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def remember(plan: Any) -> None:
    """Note a plan ``scopedckpt.plan`` just made: an out-of-memory error in one of its
    blocks' regions then says how low a plan of them can go."""
    for block in plan.blocks:
        if block.module is not None:
            _PROFILED[block.module] = weakref.ref(plan)


def _profiled(modules: Iterable[nn.Module]) -> str | None:
    """The out-of-memory note's line on the latest plan of a block among ``modules``."""
    refs = (ref for m in modules if (ref := _PROFILED.get(m)) is not None)
    plan = next((plan for ref in refs if (plan := ref()) is not None), None)
    if plan is None:
        return None
    return (
        f"scopedckpt.plan() profiled this model: no plan of its blocks peaks below "
        f"{format_bytes(plan.smallest_budget)} (without checkpointing: "
        f"{format_bytes(plan.no_checkpoint_peak)}), in measure_peak's unit."
    )


add_hint(_profiled)
