"""Context state: the active scope, the active region frame and its tape.

NOTE [ tape ]
=============
Everything that makes a recompute exact lives on a *tape*, one per region.

* A region is one call of :func:`scopedckpt.checkpoint` (or of a module that
  :func:`scopedckpt.checkpointing` selected) inside an enabled scope with grad
  enabled. Its *first forward* runs with a ``FORWARD`` frame on a fresh tape;
  every *recompute* runs with a new ``RECOMPUTE`` frame (cursor 0) on the same
  tape. Frames are per entry, so a region can be recomputed any number of
  times, partially (torch's early stop abandons a frame half-way) or never.
* Scoped layers take one record per call, keyed by call order: in ``FORWARD``
  they append what they decided (a dropout seed, a batch-norm mode); in
  ``RECOMPUTE`` they read the record at the cursor and must find their own
  kind and owner there, else :class:`ScopedCkptError` names the layer and call
  index (data-dependent control flow would otherwise replay a wrong mask).
* A nested region is itself a record on its parent's tape holding the child
  tape. When the parent is recomputed, the nested call finds its child tape
  and replays it, both in that forward and in its own later recomputes.
* Outside any region (``phase() is Phase.NONE``) layers behave like their
  torch parents and record nothing.
* Both context variables are set by the checkpoint machinery itself when a
  recompute starts, because the recompute runs inside ``loss.backward()``,
  usually after the ``with checkpointing()`` block exited, and on CUDA in an
  autograd worker thread that never saw the forward's context.
* ``checkpointing(enabled=False)`` only stops *new* regions from starting; a
  frame already active stays, so layers inside keep recording and replaying.
* Besides the call-ordered records, a tape holds the default generators' states
  at the region's start (NOTE [ RNG replay ] in ``_rng.py``) and the states of
  modules whose buffers the first forward changed, keyed by module and call
  index (NOTE [ buffer guard ] in ``_guard.py``).
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ._errors import ScopedCkptError
from ._torch_private import version_of

if TYPE_CHECKING:  # the mechanisms' own types; they import this module
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from ._generators import Generators
    from ._module_state import GuardEntry, ModuleState
    from ._policy import SavePolicy
    from ._report import RegionStats
    from ._rng import RngStash
    from ._selective import Saved, SavingMode
    from ._subtree import Listing
    from ._verify import Verifying
    from ._written import Copies, Noted

__all__ = ["Phase"]


class Phase(enum.Enum):
    """Where the current code runs relative to checkpoint regions.

    Attributes
    ----------
    NONE
        Not inside a checkpoint region: layers behave like their torch parents.
    FORWARD
        The first forward of a region: scoped layers record what they decide.
    RECOMPUTE
        A backward recompute of a region: scoped layers replay the first
        forward and leave running statistics alone.

    Example
    -------
    >>> import scopedckpt
    >>> scopedckpt.phase() is scopedckpt.Phase.NONE
    True
    """

    NONE = "none"
    FORWARD = "forward"
    RECOMPUTE = "recompute"


# The members as module constants, for hot comparisons (``frame.phase is RECOMPUTE``):
# looking a member up on its Enum class is a metaclass attribute lookup.
NONE, FORWARD, RECOMPUTE = Phase.NONE, Phase.FORWARD, Phase.RECOMPUTE


@dataclass(frozen=True)
class Scope:
    """What one ``checkpointing(...)`` block made active in its context."""

    enabled: bool
    strict: bool
    modules: frozenset[int] = frozenset()  # ids of selected module instances
    classes: tuple[type, ...] = ()  # every instance of these is selected
    keep: tuple[Any, ...] = ()  # strong refs so the ids above stay valid
    patches: tuple[Any, ...] = ()  # _targets.Patches of this scope and its parents
    root: Any = None  # the model module paths in error messages are relative to
    save: Any = None  # _policy.SavePolicy of the regions this scope makes, or None
    determinism_check: str = "default"  # of its regions whose call leaves it at "default"
    # Plans' choices: module id -> its regions' SavePolicy (None: full), over ``save``.
    saves: dict[int, Any] = field(default_factory=dict, compare=False)

    def policy_for(self, owner: object | None) -> Any:
        """The ``save=`` policy of a region this scope makes for ``owner``'s forward."""
        if self.saves and id(owner) in self.saves:
            return self.saves[id(owner)]
        return self.save

    def selects(self, module: object) -> bool:
        """Whether ``module``'s forward is a region in this scope."""
        if not self.enabled:
            return False
        return id(module) in self.modules or isinstance(module, self.classes)


@dataclass
class Record:
    """One scoped call on a tape (see NOTE [ tape ])."""

    kind: str
    owner_id: int | None  # None: any owner may replay it (see Frame.take)
    label: object  # the layer or function, named only in error messages (see describe)
    value: Any


@dataclass(slots=True)
class RegionCall:
    """One region as it starts: what its mechanisms read to fill its tape."""

    owner: object | None  # the module whose forward the region is, if any
    label: object  # the layer or function named in errors and reports
    scope: Scope
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    preserve_rng_state: bool
    save: SavePolicy | None  # overrides the scope's policy
    determinism_check: str = "default"
    # The module the region runs: its owner, the module called, or the layer of a bound
    # method or partial (engine.region_module).
    module: nn.Module | None = None
    fn: object = None  # the function the region runs
    listing: Listing | None = None  # module's subtree (_subtree.subtree), looked up once
    # The arguments, sorted once for the mechanisms that read them (__post_init__): the
    # tensors with their version counters, and the rest; each by position or keyword.
    tensors: list[tuple[int | str, Tensor, int]] = field(init=False)
    others: list[tuple[int | str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        tensors: list[tuple[int | str, Tensor, int]] = []
        others: list[tuple[int | str, Any]] = []
        self.tensors, self.others = tensors, others
        for key, value in enumerate(self.args):
            if isinstance(value, Tensor):
                tensors.append((key, value, version_of(value)))
            else:
                others.append((key, value))
        if self.kwargs:
            for name, value in self.kwargs.items():
                if isinstance(value, Tensor):
                    tensors.append((name, value, version_of(value)))
                else:
                    others.append((name, value))


@dataclass(slots=True, init=False)  # __init__ below: one is made per region
class Tape:
    """The records of one region, in call order, and what its recomputes restore.

    Each field past ``records`` belongs to one mechanism (NOTE [ region
    mechanisms ] in ``_engine.py``), which fills it when the region starts.
    """

    records: list[Record] = field(default_factory=list)
    rng: RngStash | None = None  # _rng: None when the region does not replay the RNG
    generators: Generators | None = None  # _generators: explicit generators, their states
    states: dict[tuple[int, int], ModuleState] = field(default_factory=dict)  # _guard
    # _guard: each module the first forward called, by id, with its mode then.
    modes: dict[int, tuple[Any, bool]] = field(default_factory=dict)
    stats: RegionStats | None = None  # _report: while a memory_report() block measures it
    saved: Saved | None = None  # _selective: when the region has a save= policy
    verifying: Verifying | None = None  # _verify: a region with determinism_check="bitwise"
    # _inputs: the region's call (its tensor inputs' versions), until its forward ends.
    inputs: RegionCall | None = None
    # _written: the subtree's versions and copies until the first forward ends, then the
    # copies of what it wrote, or the listing whose learning its recompute ends, or None.
    written: Noted | Copies | Listing | None = None
    # The enter_frame of each mechanism acting in this region's frames, in order, by phase.
    forward_mechanisms: tuple[Callable[[Frame], Callable[..., Any] | None], ...] = ()
    recompute_mechanisms: tuple[Callable[[Frame], Callable[..., Any] | None], ...] = ()

    def __init__(self, records: list[Record] | None = None) -> None:
        self.records = [] if records is None else records
        self.states = {}
        self.modes = {}
        self.rng = None
        self.generators = None
        self.stats = None
        self.saved = None
        self.verifying = None
        self.inputs = None
        self.written = None
        self.forward_mechanisms = ()
        self.recompute_mechanisms = ()


@dataclass(slots=True, init=False)  # __init__ below: one is made per region entry
class Frame:
    """One entry into a region: its phase, tape, replay cursor and owner.

    ``rewind``: a backward recompute puts the generators' states it found back
    on exit; a nested region replayed inside its parent's recompute does not,
    since the parent's later draws continue from it (NOTE [ RNG replay ]).
    """

    phase: Phase
    tape: Tape
    scope: Scope
    owner: object | None = None  # the module whose forward this region is
    rewind: bool = False
    cursor: int = 0
    calls: dict[int, int] = field(default_factory=dict)  # guarded module id -> calls so far
    guards: list[GuardEntry] = field(default_factory=list)  # _guard: modules running now
    selective: SavingMode | None = None  # _selective: tracks module calls (module policies)
    modules: list[tuple[int, int]] = field(default_factory=list)  # (id, call index) running now
    hooks: list[RemovableHandle] | None = None  # _guard: a recompute's own; None: global ones
    # _guard: a recompute's own post hooks where global pre-hooks guard its calls.
    exits: list[RemovableHandle] | None = None

    def __init__(
        self,
        phase: Phase,
        tape: Tape,
        scope: Scope,
        owner: object | None = None,
        rewind: bool = False,
    ) -> None:
        self.phase = phase
        self.tape = tape
        self.scope = scope
        self.owner = owner
        self.rewind = rewind
        self.cursor = 0
        self.calls = {}
        self.guards = []
        self.selective = None
        self.modules = []
        self.hooks = None
        self.exits = None

    def take(self, kind: str, owner_id: int | None, label: object) -> Record:
        """Return the next record in ``RECOMPUTE``, checking it belongs to the owner."""
        index = self.cursor
        if index >= len(self.tape.records):
            raise ScopedCkptError(
                f"scopedckpt: the recompute of a checkpoint region made scoped call "
                f"#{index} ({kind} of {self.name(label)}), but its first forward made only "
                f"{len(self.tape.records)} scoped calls. The region's control flow must "
                "not depend on data that changes between forward and backward; move the "
                "branch outside the region or checkpoint each branch separately."
            )
        record = self.tape.records[index]
        if record.kind != kind or record.owner_id != owner_id:
            raise ScopedCkptError(
                f"scopedckpt: the recompute of a checkpoint region made scoped call "
                f"#{index} as {kind} of {self.name(label)}, but the first forward made call "
                f"#{index} as {record.kind} of {self.name(record.label)}. Replaying would use "
                "the wrong mask or statistics; the region's control flow must not depend "
                "on data that changes between forward and backward."
            )
        self.cursor = index + 1
        return record

    def name(self, label: object) -> str:
        """A layer for an error message: torch's repr, and its module path where known.

        Two ``Dropout(p=0.5)`` swapping places read the same by repr alone.
        """
        from torch import nn

        text = describe(label)
        if isinstance(label, nn.Module):
            path = module_path(label, self)
            if path.startswith("'"):
                text += f" at {path.split(' (')[0]}"
        return text


# The scope of regions that other code asks for when no checkpointing() block is
# active (Hugging Face's layers, torch's checkpoint under patch_torch_checkpoint).
DEFAULT_SCOPE = Scope(enabled=True, strict=False)

SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "scopedckpt_scope", default=None
)
FRAME: contextvars.ContextVar[Frame | None] = contextvars.ContextVar(
    "scopedckpt_frame", default=None
)


def describe(owner: object) -> str:
    """A short name for error messages: the class and the torch ``repr`` details."""
    extra = getattr(owner, "extra_repr", None)
    details = extra() if callable(extra) else ""
    name = getattr(owner, "__qualname__", None) or type(owner).__name__
    return f"{name}({details})" if details or not callable(owner) else name


def region_name(call: RegionCall) -> str:
    """Name a region for an error message: the forward of its owner where it has one, else
    its layer or function."""
    if call.owner is not None:
        return f"the forward of {module_path(call.owner, None, call.scope)}"
    return describe(call.label)


def module_path(module: object, frame: Frame | None, scope: Scope | None = None) -> str:
    """Name ``module`` for an error message: its qualified name where one is known.

    Looked up (only when an error is raised) in the scope's ``root``, the
    region's owner and the scope's module targets, in that order.
    """
    from torch import nn

    kind = type(module).__name__
    roots: list[tuple[str, Any]] = []
    scope = frame.scope if frame is not None else scope
    if scope is not None and scope.root is not None:
        roots.append(("", scope.root))
    if frame is not None and isinstance(frame.owner, nn.Module):
        roots.append((type(frame.owner).__name__, frame.owner))
    if scope is not None:
        roots.extend((type(m).__name__, m) for m in scope.keep if m is not module)
    for prefix, root in roots:
        for name, candidate in root.named_modules():
            if candidate is module:
                path = ".".join(p for p in (prefix, name) if p) or "<root>"
                return f"'{path}' ({kind})"
    return f"a {kind} module"
