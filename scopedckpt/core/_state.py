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
  at the region's start (NOTE [ RNG replay ] in ``_rng.py``) and copies of the
  state of modules with buffers, keyed by module: its subtree's at its start,
  others' at their first call (NOTE [ buffer guard ] in ``_guard.py``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ._errors import ScopedCkptError
from ._names import describe as describe
from ._names import frame_region_name, layer_place
from ._names import module_path as module_path
from ._names import region_name as region_name
from ._names import region_name_of as region_name_of
from ._torch_private import version_of

if TYPE_CHECKING:
    from torch import nn

    from ._policy import SavePolicy
    from ._sampling import Site
    from ._subtree import Listing

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
    keep: tuple[Any, ...] = ()  # strong refs so the ids above stay valid; named in messages
    patches: tuple[Any, ...] = ()  # _targets.Patches of this scope and its parents
    root: Any = None  # the model module paths in error messages are relative to
    save: Any = None  # _policy.SavePolicy of the regions this scope makes, or None
    determinism_check: str = "default"  # of its regions whose call leaves it at "default"
    # Plans' choices: module id -> its regions' SavePolicy (None: full), over ``save``.
    saves: dict[int, Any] = field(default_factory=dict, compare=False)
    # The nn.ModuleList and nn.ModuleDict targets, whose children are in ``keep``: messages
    # name those children by their keys in them (NOTE [ naming ] in _names.py).
    containers: tuple[Any, ...] = ()
    # torch.Generators its regions stash and replay (NOTE [ forward's world ])
    generators: tuple[Any, ...] = ()

    def policy_for(self, owner: object | None) -> Any:
        """The ``save=`` policy of a region this scope makes for ``owner``'s forward."""
        if self.saves and id(owner) in self.saves:
            return self.saves[id(owner)]
        return self.save

    def selects(self, module: object) -> bool:
        """Whether ``module``'s forward is a region in this scope."""
        return self.enabled and (id(module) in self.modules or isinstance(module, self.classes))


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
    site: Site | None = None  # _sampling.site under the default check, else None
    # The arguments, sorted once for the mechanisms that read them (__post_init__): the
    # tensors with their version counters, and the rest; each by position or keyword.
    tensors: list[tuple[int | str, Tensor, int]] = field(init=False)
    others: list[tuple[int | str, Any]] = field(init=False)

    def without_arguments(self) -> RegionCall:
        """This call without its arguments, for what outlives the region's forward."""
        return dataclasses.replace(self, args=(), kwargs={})

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
    rng: Any = None  # _rng's RngStash: None when the region does not replay the RNG
    generators: Any = None  # _generators' Generators: explicit ones, their states
    states: dict[int, Any] = field(default_factory=dict)  # _guard's ModuleStates, by module id
    # _guard: each module the first forward called, by id, with its mode then.
    modes: dict[int, tuple[Any, bool]] = field(default_factory=dict)
    stats: Any = None  # _report's RegionStats, while a memory_report() block measures it
    saved: Any = None  # _selective's Saved, when the region has a save= policy
    verifying: Any = None  # _verify's Verifying: a region with determinism_check="bitwise"
    # _inputs: the region's call (its tensor inputs' versions), until its forward ends.
    inputs: RegionCall | None = None
    # _written's Written: the region's parameters, their versions until its first forward
    # ends, and copies of their values before it.
    written: Any = None
    world: Any = None  # _world's World: the region's recorded world
    hooks: Any = None  # _hooks' Hooks: the user hooks of its subtree
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
        self.world = None
        self.hooks = None
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
    # _guard: module id -> its calls so far (selective saving's numbering)
    calls: dict[int, int] = field(default_factory=dict)
    # _guard: strict mode's (module, copies of its buffers), one per guarded call running
    guards: list[Any] = field(default_factory=list)
    selective: Any = None  # _selective's SavingMode: tracks module calls (module policies)
    modules: list[tuple[int, int]] = field(default_factory=list)  # (id, call index) running now
    # _guard: a recompute that installed no global hooks, whose calls other frames' leave
    unhooked: bool = False

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
        self.unhooked = False

    def take(self, kind: str, owner_id: int | None, label: object) -> Record:
        """Return the next record in ``RECOMPUTE``, checking it belongs to the owner."""
        index = self.cursor
        if index >= len(self.tape.records):
            raise ScopedCkptError(
                f"scopedckpt: the recompute of {frame_region_name(self)} made more scoped "
                "calls than its first forward: move data-dependent branches out of it."
                f"\nIts scoped call #{index} ({kind} of {self.name(label)}) has nothing to "
                f"replay: the first forward made only {len(self.tape.records)} scoped calls. "
                "The region's control flow must not depend on data that changes between "
                "forward and backward; move the branch outside the region or checkpoint each "
                "branch separately."
            )
        record = self.tape.records[index]
        if record.kind != kind or record.owner_id != owner_id:
            raise ScopedCkptError(
                f"scopedckpt: the recompute of {frame_region_name(self)} made its scoped "
                "calls in another order: move data-dependent branches out of it."
                f"\nThe recompute made call #{index} as {kind} of {self.name(label)}, but the "
                f"first forward made call #{index} as {record.kind} of "
                f"{self.name(record.label)}. Replaying would use the wrong mask or statistics; "
                "the region's control flow must not depend on data that changes between "
                "forward and backward."
            )
        self.cursor = index + 1
        return record

    def name(self, label: object) -> str:
        """A layer for an error message: torch's repr, and its module path where known.

        Two ``Dropout(p=0.5)`` swapping places read the same by repr alone.
        """
        place = layer_place(label, self)
        return describe(label) if place is None else f"{describe(label)} at {place}"


# The scope of regions that other code asks for when no checkpointing() block is
# active (Hugging Face's layers, torch's checkpoint under patch_torch_checkpoint).
DEFAULT_SCOPE = Scope(enabled=True, strict=False)

SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "scopedckpt_scope", default=None
)
FRAME: contextvars.ContextVar[Frame | None] = contextvars.ContextVar(
    "scopedckpt_frame", default=None
)
