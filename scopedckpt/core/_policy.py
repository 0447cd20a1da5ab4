"""What a region saves instead of recomputing: ``save=`` policies, parsed once.

A policy is a sequence whose items select op calls inside a region (see
NOTE [ selective saving ] in ``_selective.py`` for what a selected call does):

* an aten op overload (``torch.ops.aten.mm.default``) or packet
  (``torch.ops.aten.mm``, every overload): calls of that op;
* an ``nn.Module`` instance or class, or a qualified-name pattern relative to
  the region's module (``"self_attn"``, ``"mlp.*"``, ``fnmatch`` syntax): every
  op called while such a module's forward runs inside the region;
* a callable ``(ctx, op, *args, **kwargs)`` returning a bool or a
  ``torch.utils.checkpoint.CheckpointPolicy``, as for torch's selective
  checkpointing: calls for which it says save.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from ._errors import ScopedCkptError
from ._names import describe
from ._torch_private import OpOverload, OpOverloadPacket, tracing

__all__ = ["SavePolicy", "as_policy"]

OpPolicy = Callable[..., Any]

_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
_FORWARD_CONTEXT = SelectiveCheckpointContext(is_recompute=False)


class SavePolicy:
    """A parsed ``save=`` sequence: which op calls a region keeps from its first forward.

    Built by :func:`as_policy`; users pass plain sequences (see
    :mod:`scopedckpt.policies` for presets).
    """

    def __init__(self, items: Iterable[Any]) -> None:
        self.items: tuple[Any, ...] = tuple(items)
        overloads: set[Any] = set()
        packets: set[Any] = set()
        modules: dict[int, nn.Module] = {}
        classes: list[type] = []
        patterns: list[str] = []
        callables: list[OpPolicy] = []
        for index, item in enumerate(self.items):
            if isinstance(item, OpOverload):
                overloads.add(item)
            elif isinstance(item, OpOverloadPacket):
                packets.add(item)
            elif isinstance(item, nn.Module):
                modules[id(item)] = item
            elif isinstance(item, type) and issubclass(item, nn.Module):
                classes.append(item)
            elif isinstance(item, str):
                patterns.append(item)
            elif callable(item) and not isinstance(item, type):
                callables.append(item)
            else:
                raise TypeError(
                    f"scopedckpt: save= item #{index} is {item!r} "
                    f"({type(item).__name__}); expected an aten op "
                    "(torch.ops.aten.mm or torch.ops.aten.mm.default), an nn.Module "
                    "instance or class, a qualified-name pattern such as 'mlp.*', or a "
                    "callable (ctx, op, *args, **kwargs) -> bool. Presets are in "
                    "scopedckpt.policies."
                )
        self.overloads = frozenset(overloads)
        self.packets = frozenset(packets)
        self.modules = modules  # strong refs: the ids stay valid while the policy lives
        self.classes = tuple(classes)
        self.patterns = tuple(patterns)
        self.callables = tuple(callables)
        # Whether any item selects by module (the region must track module calls).
        # A plain attribute: compiled code reads it (NOTE [ torch.compile ]).
        self.selects_modules = bool(self.modules or self.classes or self.patterns)
        # Only op items: a call's fate depends on its op alone, so other ops need
        # no numbering (the fast path of _selective's modes).
        self.only_ops = not (self.selects_modules or self.callables)
        self._patterns_of: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = (
            weakref.WeakKeyDictionary()
        )
        # Compiled regions name the policy by this number: the context_fn torch
        # takes under dynamo must be a constant (compiled_contexts).
        self.key = next(_KEYS)
        _BY_KEY[self.key] = self

    def __repr__(self) -> str:
        return f"SavePolicy({list(self.items)!r})"

    def names(self, func: Any) -> bool:
        """Whether an op item selects this op."""
        return func in self.overloads or func.overloadpacket in self.packets

    def explicit(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether an op item or a callable selects this op call."""
        if self.names(func):
            return True
        for policy in self.callables:
            decision = policy(_FORWARD_CONTEXT, func, *args, **kwargs)
            if decision is True or decision in _SAVE:
                return True
        return False

    def torch_policy(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        """This policy as torch's selective checkpointing asks for it (compiled regions)."""
        if self.explicit(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def matched_modules(self, owner: object | None, label: object) -> frozenset[int]:
        """Ids of the modules inside the region that module items select.

        Patterns are matched against qualified names relative to the region's
        module (the owner, or the function when it is a module), computed once
        per module.
        """
        if not self.patterns:
            return frozenset()
        root = owner if isinstance(owner, nn.Module) else label
        if not isinstance(root, nn.Module):
            raise ScopedCkptError(
                f"scopedckpt: save= has name patterns {list(self.patterns)}, but the region "
                f"{describe(label)} is not a module: checkpoint a module, whose paths they "
                "match.\n"
                "A function's region has no names to match the patterns against. Checkpoint a "
                "module (checkpointing(model.layers, save=...) or checkpoint(module, x, "
                "save=...)), or select the modules by instance or class instead of by name."
            )
        found = self._patterns_of.get(root)
        if found is None:
            found = frozenset(
                id(module)
                for name, module in root.named_modules()
                if name and any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
            )
            self._patterns_of[root] = found
        return found

    def selects_module(self, module: nn.Module, matched: frozenset[int]) -> bool:
        """Whether every op of this module's forward is selected."""
        return (
            id(module) in self.modules or id(module) in matched or isinstance(module, self.classes)
        )


_KEYS = itertools.count()
_BY_KEY: weakref.WeakValueDictionary[int, SavePolicy] = weakref.WeakValueDictionary()


def compiled_contexts(key: int) -> tuple[Any, Any]:
    """The ``context_fn`` of a compiled region with ``policy`` (NOTE [ torch.compile ]).

    Where AOT autograd traces the region, torch's selective checkpointing
    marks the ops to save in the graph. Where dynamo ran torch's checkpoint
    eagerly instead (a graph break in the region), the region's body enters
    scopedckpt's frames, whose own modes save: torch's then stay out.
    """
    policy = _BY_KEY.get(key)
    if policy is None or not tracing():
        return contextlib.nullcontext(), contextlib.nullcontext()
    return create_selective_checkpoint_contexts(policy.torch_policy)


_TRACED: dict[int, SavePolicy] = {}


def traced_policy_info(save: Any) -> tuple[int, bool]:
    """A ``save=`` sequence given in compiled code, as constants dynamo can carry:
    the policy's key and whether it selects modules. Op policies stay alive for
    the compiled regions that name them (a bounded number)."""
    policy = as_policy(save)
    if policy is None:
        return -1, False
    if not policy.selects_modules:
        if len(_TRACED) >= 256:
            _TRACED.pop(next(iter(_TRACED)))
        _TRACED[policy.key] = policy
    return policy.key, policy.selects_modules


# Policies of ops, patterns and classes, interned by their items and by key; the
# oldest goes when there are _INTERNED_MAX (compiled regions keep theirs: _TRACED).
_INTERNED: dict[tuple[Any, ...], SavePolicy] = {}
_INTERNED_BY_KEY: dict[int, SavePolicy] = {}
_INTERNED_MAX = 256
_INTERNABLE = (OpOverload, OpOverloadPacket, str, type)


@torch.compiler.assume_constant_result  # NOTE [ policies built in compiled code ]
def _intern(items: tuple[Any, ...]) -> int:
    """The key of the interned policy of ``items`` (all internable), built on first use."""
    key = tuple((type(item), item) for item in items)
    policy = _INTERNED.get(key)
    if policy is None:
        if len(_INTERNED) >= _INTERNED_MAX:
            oldest = next(iter(_INTERNED))
            del _INTERNED_BY_KEY[_INTERNED.pop(oldest).key]
        policy = _INTERNED[key] = SavePolicy(items)
        _INTERNED_BY_KEY[policy.key] = policy
    return policy.key


def as_policy(save: Any) -> SavePolicy | None:
    """``save=`` as a :class:`SavePolicy` (None or empty: save nothing).

    Equal sequences of ops, patterns and classes give the same policy object,
    so code that builds ``checkpointing(..., save=[...])`` at every step does
    not make compiled code recompile (dynamo guards on the policy's identity).
    """
    if save is None or isinstance(save, SavePolicy):
        return save
    if isinstance(save, (str, bytes)) or not isinstance(save, Iterable):
        raise TypeError(
            f"scopedckpt: save= must be a sequence of items (ops, modules, module classes, "
            f"name patterns or callables), got {type(save).__name__}. Wrap a single item "
            "in a list: save=[torch.ops.aten.mm]."
        )
    items = tuple(save)
    if not items:
        return None
    if not all(isinstance(item, _INTERNABLE) for item in items):
        # Module instances and callables: interning would keep them alive.
        return SavePolicy(items)
    # NOTE [ policies built in compiled code ]
    # ========================================
    # checkpointing(save=[...]) may be entered inside compiled code, where dynamo
    # cannot trace building a SavePolicy (weak references; it failed or not
    # depending on what ran before). _intern is a constant-result call: dynamo
    # runs it at trace time and its result, the key, is a constant of the graph.
    # Reading _INTERNED here instead would guard on a dict that call changes.
    return _INTERNED_BY_KEY[_intern(items)]
