"""Selective saving: a region keeps the outputs of chosen ops and recomputes the rest.

NOTE [ selective saving ]
=========================
``checkpointing(..., save=policy)`` and ``checkpoint(fn, ..., save=policy)``
trade memory for compute inside a region (policies: ``_policy.py``). It works
like torch's selective activation checkpointing, a dispatch mode over the
region's aten ops, with the differences exactness needs:

* First forward (:class:`SavingMode`): every op call of the region (not of a
  nested region, which has its own tape, and not of scopedckpt's own
  bookkeeping or dropout masks, see ``core/_own_ops.py``) is numbered per op overload *and per
  module call running it* (the innermost module's id and call index, tracked
  by the buffer guard's hooks), and the decision is recorded at that number:
  the output, detached (so the tape holds no autograd graph), or "recompute".
  Recording every call, not only saved ones, lets module- and call-dependent
  policies be decided once, in forward; a policy of op items only decides by
  op alone, so other ops pass straight through (the mode's cost per op is
  most of what selective saving costs on small ops). Numbering per module call confines
  the ops a layer issues in only one of the two runs to that layer: scoped
  batch norm reads ``num_batches_tracked`` (an ``item()``) in forward but not
  in its recompute, and with one count per op the thorough property test
  found a later dropout's kept seed served to the wrong call.
* Recompute (:class:`ServingMode`): the n-th call of an op finds its record;
  a saved call returns fresh aliases of the kept outputs without running.
  Records are read, never consumed, so any number of recomputes
  (``retain_graph``, ``autograd.grad`` then ``backward``, early stop, a nested
  region replayed in its parent's recompute) see the same outputs.
* Autograd sits above the dispatch mode, so a saved op still records its
  graph node and saves what its backward needs in the recompute: torch's
  checkpoint sees the same saved tensors in the same order.
* Exactness, case by case. Kept outputs are the first forward's bits, and every
  recomputed op gets bitwise the inputs it had then. Batch norm saved is not
  rerun, so it updates nothing; recomputed, it is scoped or guarded as
  always. A saved op that draws from the default generators
  (``torch.bernoulli(p)``, fused attention with ``dropout_p``) also records
  the generators' states after it; the recompute sets them when it skips the
  op, so unscoped draws after it stay aligned (NOTE [ RNG replay ]).
* An output changed in place after it was saved (``ReLU(inplace=True)`` after
  a saved batch norm: torch's SAC raises "Tensor cached ... has been
  mutated") no longer holds the value the op returned. The version counter
  tells, and the recompute runs that op instead: exact, that op's saving lost.
* Some ops cannot be saved (``policies.keepable``). Ops that mutate an
  argument or return a view of one: a kept output would stand apart from the
  tensor the recompute's code changes or reads through. Tensor factories
  (``torch.zeros``, ``torch.rand``, ``*_like``): torch's Python bindings wrap
  their result in a new tensor object with its own version counter, so the
  check above could not see it changed (measured: ``rand(...).lt_()`` left
  the kept alias's version at 0). An op item or callable that selects one
  raises :class:`ScopedCkptError` naming the op and the region; inside a
  module selected by a module item they are recomputed (they cost little).
* A recompute call whose tensor arguments differ in shape or dtype from the
  first forward's call with the same number raises: the region ran other ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from ..core._errors import ScopedCkptError
from ..core._names import module_region
from ..core._own_ops import NumberingMode, unnumbered_now
from ..core._policy import SavePolicy
from ..core._state import FORWARD, FRAME, RECOMPUTE, Frame, RegionCall, Tape, region_name_of
from ..core._torch_private import (
    SAC_IGNORED_OPS,
    detach_below_autograd,
    op_schema_facts,
    version_of,
)
from ._rng import replays, states_now
from ._strict import draws_random_numbers

__all__ = [
    "FRAME_PHASES",
    "Saved",
    "SavingMode",
    "ServingMode",
    "enter_frame",
    "kept_tensors",
    "saves",
    "start_region",
]


@dataclass
class _Kept:
    """One saved op call."""

    outputs: Any  # the op's result with tensors detached
    versions: tuple[tuple[Tensor, int], ...]  # each kept tensor and its version when kept
    signature: tuple[Any, ...]  # shapes and dtypes of the call's tensor arguments
    rng: Any  # _rng.RngStash after a random op (when the region replays the RNG), else None


@dataclass
class Saved:
    """A region's record of op calls (on its tape), by op overload and call number."""

    policy: SavePolicy
    matched: frozenset[int]  # ids of modules selected by name patterns
    label: object  # the region, for error messages
    # (op overload, (module id, call index) running it or None) -> per call, in order
    calls: dict[tuple[Any, Any], list[_Kept | None]] = field(default_factory=dict)


_WHY_NOT: dict[Any, str | None] = {}


def why_not_keepable(func: Any) -> str | None:
    """Why an op's output cannot be kept (None: it can). See NOTE [ selective saving ]."""
    if func in _WHY_NOT:
        return _WHY_NOT[func]
    mutates, aliases, takes_tensors, name = op_schema_facts(func)
    reason = None
    if mutates:
        reason = "changes its arguments in place"
    elif aliases:
        reason = "returns a view of an argument"
    elif name.endswith("_like") or not takes_tensors:
        reason = (
            "is a tensor factory: torch's Python factory functions hand back a new tensor "
            "object, so a change to it in place could not be seen (factories are cheap to "
            "rerun, and random ones are replayed exactly)"
        )
    _WHY_NOT[func] = reason
    return reason


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    found: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            found.append((value.shape, value.dtype))
        elif isinstance(value, (list, tuple)):
            found.extend((v.shape, v.dtype) for v in value if isinstance(v, Tensor))
    return tuple(found)


def _detach(value: Any) -> Any:
    if isinstance(value, Tensor):
        return detach_below_autograd(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    return value


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _key(func: Any, frame: Frame) -> tuple[Any, Any]:
    """What a call is numbered under: its op and the module call running it."""
    modules = frame.modules
    return func, modules[-1] if modules else None


class _RegionMode(NumberingMode):
    """What both modes share: which op calls of the region are numbered."""

    def __init__(self, saved: Saved, frame: Frame) -> None:
        super().__init__()
        self._saved = saved
        self._frame = frame
        self._policy = saved.policy
        self._only_ops = saved.policy.only_ops

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        # Not numbered (in neither run): an op an op-only policy does not name, scopedckpt's
        # own bookkeeping, torch's ignored ops, a nested region's ops.
        if (
            (self._only_ops and not self._policy.names(func))
            or unnumbered_now()
            or func in SAC_IGNORED_OPS
            or FRAME.get() is not self._frame
        ):
            return func(*args, **kwargs)
        return self._numbered(func, args, kwargs)

    def _numbered(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a numbered op call: each mode's own."""
        raise NotImplementedError

    def _region(self) -> str:
        """The region, for an error message (NOTE [ naming ] in _names.py)."""
        frame = self._frame
        if frame.owner is not None:
            return module_region(frame.owner, frame.scope)
        return f"region {region_name_of(None, self._saved.label, frame.scope)}"


class SavingMode(_RegionMode):
    """The first forward of a region with a policy: record every op call's fate."""

    def __init__(self, saved: Saved, frame: Frame) -> None:
        super().__init__(saved, frame)
        self._explicit = bool(
            self._policy.overloads or self._policy.packets or self._policy.callables
        )
        self._selected: list[bool] = []  # per module call running now: selected?
        self._depth = 0  # how many selected modules are running now

    def enter_module(self, module: nn.Module) -> None:
        selected = self._policy.selects_module(module, self._saved.matched)
        self._selected.append(selected)
        self._depth += selected

    def exit_module(self) -> None:
        if self._selected:
            self._depth -= self._selected.pop()

    def _numbered(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        explicit = self._explicit and self._policy.explicit(func, args, kwargs)
        entries = self._saved.calls.setdefault(_key(func, self._frame), [])
        if not (explicit or self._depth):
            entries.append(None)
            return func(*args, **kwargs)
        reason = why_not_keepable(func)
        if reason is not None:
            if explicit:
                raise ScopedCkptError(
                    f"scopedckpt: save= selects {func} in {self._region()}, but that op "
                    f"{reason}: leave it out of the policy.\n"
                    "A kept output could not stand in for it in the recompute. A callable "
                    "policy can ask scopedckpt.policies.keepable(op); or select the op's "
                    "out-of-place form."
                )
            entries.append(None)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        kept = _detach(out)
        versions = tuple((t, version_of(t)) for t in _tensors(kept))
        tape = self._frame.tape
        rng = None
        if replays(tape) and draws_random_numbers(func, args, kwargs):
            rng = states_now(tape)
        entries.append(_Kept(kept, versions, _signature(args, kwargs), rng))
        return out


class ServingMode(_RegionMode):
    """A recompute of a region with a policy: saved calls return their kept outputs."""

    def __init__(self, saved: Saved, frame: Frame) -> None:
        super().__init__(saved, frame)
        self._counts: dict[Any, int] = {}

    def _numbered(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = _key(func, self._frame)
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        entries = self._saved.calls.get(key)
        entry = entries[index] if entries is not None and index < len(entries) else None
        if entry is None:
            return func(*args, **kwargs)
        signature = _signature(args, kwargs)
        if signature != entry.signature:
            raise ScopedCkptError(
                f"scopedckpt: the recompute of {self._region()} did not run the ops whose "
                "outputs save= kept: move data-dependent branches out of it.\n"
                f"It made call #{index} of {func} with tensor arguments {_shapes(signature)}, "
                f"but the first forward made it with {_shapes(entry.signature)}, and save= "
                "kept that call's output. The region's control flow must not depend on data "
                "that changes between forward and backward."
            )
        if any(version_of(t) != version for t, version in entry.versions):
            return func(*args, **kwargs)  # changed in place after it was kept: recompute
        if entry.rng is not None:
            entry.rng.apply()
        return _detach(entry.outputs)


def _shapes(signature: tuple[Any, ...]) -> str:
    return "(" + ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in signature) + ")"


FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})


def saves(tape: Tape) -> bool:
    """Whether the region keeps op outputs under a ``save=`` policy."""
    return tape.saved is not None


def kept_tensors(tape: Tape) -> list[Tensor]:
    """The op outputs the region keeps for its recomputes (the memory report's)."""
    saved = tape.saved
    if saved is None:
        return []
    return [t for entries in saved.calls.values() for e in entries if e for t, _ in e.versions]


def start_region(tape: Tape, call: RegionCall) -> bool:
    """A region with a policy (its own ``save=`` or its scope's) keeps a record."""
    policy = call.save if call.save is not None else call.scope.policy_for(call.owner)
    if policy is None:
        return False
    tape.saved = Saved(policy, policy.matched_modules(call.owner, call.label), call.label)
    return True


def enter_frame(frame: Frame) -> Callable[..., Any] | None:
    """Record (first forward) or serve (recompute) under the region's policy; returns
    the mode's exit."""
    saved = frame.tape.saved
    assert saved is not None  # start_region said so
    mode: SavingMode | ServingMode
    if frame.phase is FORWARD:
        mode = SavingMode(saved, frame)
        if saved.policy.selects_modules:
            frame.selective = mode  # the guard's hooks tell it module calls
    else:
        mode = ServingMode(saved, frame)
    mode.__enter__()
    return mode.__exit__
