"""The ``checkpointing`` scope: a context manager and decorator over a ContextVar."""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from . import _targets
from ._errors import ScopedCkptError
from ._names import article
from ._oom import explain_outside
from ._options import DETERMINISM_CHECKS
from ._paths import EAGER, enter_block, exit_block, where
from ._policy import SavePolicy, as_policy, traced_policy_info
from ._state import SCOPE, Scope

__all__ = ["checkpointing"]

F = TypeVar("F", bound=Callable[..., Any])

Predicate = Callable[[str, nn.Module], bool]
# Regions as a plan says them: each block with its save= items (None: a full region).
Regions = list[tuple[nn.Module, "tuple[Any, ...] | None"]]
# A module, a module class, a predicate, or an object that says its regions: one whose class
# has __checkpoint_regions__() -> (its model or None, Regions), as scopedckpt.Plan does (the
# planner depends on this module, not this module on the planner).
Target = nn.Module | type | Predicate | Any


def said_regions(target: object) -> tuple[nn.Module | None, Regions] | None:
    """The model and regions ``target`` says, where its class has ``__checkpoint_regions__``.

    Example
    -------
    >>> class Two:
    ...     def __checkpoint_regions__(self):
    ...         return None, [(nn.Linear(2, 2), None)]
    >>> said_regions(Two())[1][0][1] is None, said_regions(nn.Linear(2, 2))
    (True, None)
    """
    say = getattr(type(target), "__checkpoint_regions__", None)
    return None if say is None else say(target)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
# What a block entered where no other is active inherits: nothing (a disabled parent).
_OUTSIDE = Scope(enabled=False, strict=False)


class checkpointing:  # noqa: N801 - reads like the docs: ``with checkpointing():``
    """Make checkpoint regions active in the current context.

    Inside the block every :func:`scopedckpt.checkpoint` call (with grad
    enabled) is a checkpoint region, and so is the forward of every module the
    ``targets`` select. Scoped layers (:class:`scopedckpt.Dropout`,
    :class:`scopedckpt.BatchNorm2d`, ...) inside a region record what they
    decide in the first forward and replay it in the backward recompute.

    Scoping follows :mod:`contextvars`:

    * **Nesting.** An inner block adds its targets to the outer ones;
      ``checkpointing(enabled=False)`` stops new regions inside it (a region
      already running keeps replaying its layers exactly).
    * **Exceptions.** The scope is reset in ``finally``; nothing stays active.
    * **Threads.** A plain new thread does not see the scope; one started
      through ``contextvars.copy_context().run`` does. Module targets are
      regions only for calls made in a context where the scope is active.
    * **asyncio.** Each task runs in a copy of its creator's context, so a
      task sees the scope it was created in and a scope entered inside a task
      stays inside that task.
    * **Backward.** The recompute runs inside ``loss.backward()``, usually after
      the block exited and, on CUDA, on an autograd worker thread; each region
      carries its scope and re-enters it for the recompute, so nothing else
      needs to be active then.

    Parameters
    ----------
    *targets
        Modules whose forward becomes a region while the scope is active, with
        no wrapper modules: a module instance; an ``nn.ModuleList`` or
        ``nn.ModuleDict`` (each child); a module class (every instance of it
        and of its subclasses); a predicate ``(qualified_name, module) ->
        bool`` over ``root.named_modules()``; or a :class:`scopedckpt.Plan`
        (its regions, each with the ``save=`` preset the plan chose for it,
        which overrides ``save``; docs/memory-budget.md).
    enabled
        ``False`` turns checkpointing off inside the block.
    strict
        Raise :class:`scopedckpt.ScopedCkptError` when a region's first forward
        draws random numbers that no scoped layer drew (plain ``nn.Dropout``,
        ``torch.rand``), naming the op. ``None`` inherits the outer scope's
        setting (off by default). It costs a dispatch hook per op: a debug aid.
    root
        The model predicates are evaluated against (needed only with them);
        error messages name modules by their qualified names in it.
    save
        Selective saving: what the regions made in this block keep from their
        first forward instead of recomputing, still exactly (docs/selective.md).
        A sequence of aten ops (``torch.ops.aten.mm``), module instances or
        classes inside the regions, qualified-name patterns relative to the
        region's module (``"mlp.*"``), or callables ``(ctx, op, *args,
        **kwargs) -> bool`` as for torch's selective checkpointing; presets are
        in :mod:`scopedckpt.policies`. ``None`` inherits the outer block's.
    determinism_check
        How the regions made in this block check their recomputes, where a
        region's own call leaves it at ``"default"``: ``"default"`` (torch
        compares shapes, dtypes and devices), ``"bitwise"`` (values too, bit for
        bit, from fingerprints: NOTE [ bitwise verification ]) or ``"none"``.
        ``None`` inherits the outer block's.
    generators
        ``torch.Generator`` objects the regions made in this block draw from with
        ``generator=`` where scopedckpt cannot find them itself (a global, a helper
        object's): each region stashes their states when it starts and every
        recompute replays them (NOTE [ forward's world ]). Added to the outer block's.

    Raises
    ------
    TypeError
        If a target is neither a module, a module class nor a callable, a
        flag is not a bool, or a ``save`` item is none of the kinds above.
    ValueError
        If a predicate target is given without ``root``, or ``determinism_check``
        is not one of the above.

    Example
    -------
    >>> import torch, scopedckpt
    >>> model = torch.nn.Sequential(
    ...     torch.nn.Linear(8, 8), scopedckpt.BatchNorm1d(8), scopedckpt.Dropout(0.1))
    >>> x = torch.randn(4, 8)
    >>> with scopedckpt.checkpointing(model):
    ...     loss = model(x).square().sum()
    >>> loss.backward()
    >>> int(model[1].num_batches_tracked)   # once, not twice
    1
    """

    def __init__(
        self,
        *targets: Target,
        enabled: bool = True,
        strict: bool | None = None,
        root: nn.Module | None = None,
        save: Any = None,
        determinism_check: str | None = None,
        generators: Sequence[torch.Generator] = (),
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(
                f"scopedckpt: checkpointing(enabled=...) must be a bool, got "
                f"{type(enabled).__name__}. Module targets go before the keywords: "
                "checkpointing(model.blocks, enabled=True)."
            )
        if strict is not None and not isinstance(strict, bool):
            raise TypeError(
                f"scopedckpt: checkpointing(strict=...) must be a bool or None, got "
                f"{type(strict).__name__}."
            )
        if root is not None and not isinstance(root, nn.Module):
            raise TypeError(
                f"scopedckpt: checkpointing(root=...) must be an nn.Module, got "
                f"{type(root).__name__}."
            )
        if determinism_check is not None and determinism_check not in DETERMINISM_CHECKS:
            raise ValueError(
                f"scopedckpt: checkpointing(determinism_check=...) must be one of "
                f"{DETERMINISM_CHECKS} or None, got {determinism_check!r}."
            )
        generators = tuple(generators)
        for index, generator in enumerate(generators):
            if not isinstance(generator, torch.Generator):
                raise TypeError(
                    f"scopedckpt: checkpointing(generators=...) takes torch.Generator "
                    f"objects, but item #{index} is {article(type(generator).__name__)}."
                )
        self._generators = generators
        self._determinism_check = determinism_check
        self._targets = targets
        self._enabled = enabled
        self._strict = strict
        self._save_items = save
        self._save: SavePolicy | None = as_policy(save)
        self._modules, self._classes, self._saves = resolve_targets(targets, root)
        self._containers = tuple(t for t in targets if isinstance(t, _CONTAINERS))
        models = (said[0] for t in targets if (said := said_regions(t)) is not None)
        self._root = root if root is not None else next(models, None)
        self._entries: list[tuple[contextvars.Token[Scope | None], _targets.Patches, Any]] = []
        self._traced: list[tuple[tuple[bool, Any], list[tuple[nn.Module, Any]]]] = []

    def __repr__(self) -> str:
        parts = [
            repr(t) if not isinstance(t, nn.Module) else type(t).__name__ for t in self._targets
        ]
        parts.append(f"enabled={self._enabled}")
        if self._strict is not None:
            parts.append(f"strict={self._strict}")
        if self._save is not None:
            parts.append(f"save={list(self._save.items)!r}")
        return f"checkpointing({', '.join(parts)})"

    def __enter__(self) -> checkpointing:
        if where() is not EAGER:  # NOTE [ torch.compile ] in _compiled.py
            if self._saves:
                raise ScopedCkptError(
                    "scopedckpt: checkpointing(plan) was entered inside a compiled "
                    "function, where a block's forward cannot carry the save= preset the "
                    "plan chose for it. Enter it around the call of the compiled model "
                    "(with checkpointing(plan): loss = compiled(x)...)."
                )
            self._traced.append(_targets.enter_traced(self._modules, self._enabled, self._save))
            return self
        parent = SCOPE.get() or _OUTSIDE
        modules = tuple(self._modules)
        saves = {**parent.saves, **self._saves} if parent.saves else self._saves
        patches = _targets.install(modules, self._classes)
        scope = Scope(
            self._enabled,
            parent.strict if self._strict is None else self._strict,
            parent.modules | {id(m) for m in modules},
            parent.classes + tuple(c for c in self._classes if c not in parent.classes),
            parent.keep + modules,
            parent.patches + ((patches,) if patches.holders else ()),
            self._root if self._root is not None else parent.root,
            self._save if self._save is not None else parent.save,
            self._determinism_check or parent.determinism_check,
            saves,
            parent.containers + self._containers,
            parent.generators + self._generators,
        )
        delta = int(self._enabled) - int(parent.enabled)
        token = SCOPE.set(scope)
        planned = None
        if saves and (scope.save is not None or any(p is not None for p in saves.values())):
            planned = {key: traced_policy_info(policy) for key, policy in saves.items()}
        self._entries.append((token, patches, enter_block(delta, scope.save, planned)))
        return self

    def __exit__(self, *exc: object) -> None:
        if where() is not EAGER:
            _targets.exit_traced(*self._traced.pop())
            return
        if len(exc) > 1 and isinstance(exc[1], torch.OutOfMemoryError):
            modules = [t for t in (self._root, *self._targets) if isinstance(t, nn.Module)]
            explain_outside(exc[1], "a checkpointing() scope", modules)
        token, patches, mirrored = self._entries.pop()
        try:
            SCOPE.reset(token)
        finally:
            exit_block(mirrored)
            patches.remove()

    def _fresh(self) -> checkpointing:
        return checkpointing(
            *self._targets,
            enabled=self._enabled,
            strict=self._strict,
            root=self._root,
            save=self._save_items,
            determinism_check=self._determinism_check,
            generators=self._generators,
        )

    def __call__(self, func: F) -> F:
        """Use the scope as a decorator: every call of ``func`` runs inside it."""
        # A fresh scope object per call keeps concurrent calls' tokens apart.
        return decorate(self._fresh, func)


def decorate(fresh: Callable[[], Any], func: F) -> F:
    """Run every call of ``func`` (sync or async) inside a new ``fresh()`` context manager."""
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            with fresh():
                return await func(*args, **kwargs)

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with fresh():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def resolve_targets(
    targets: tuple[Target, ...], root: nn.Module | None
) -> tuple[list[nn.Module], tuple[type, ...], dict[int, SavePolicy | None]]:
    """Split targets into module instances, module classes and the policies plans
    chose (module id to its ``save=`` policy, None for a full region)."""
    modules: list[nn.Module] = []
    classes: list[type] = []
    saves: dict[int, SavePolicy | None] = {}
    for index, target in enumerate(targets):
        said = said_regions(target)
        if said is not None:
            for module, items in said[1]:
                modules.append(module)
                saves[id(module)] = None if items is None else as_policy(items)
        elif isinstance(target, _CONTAINERS):
            modules.extend(target.values() if isinstance(target, nn.ModuleDict) else target)
        elif isinstance(target, nn.Module):
            modules.append(target)
        elif isinstance(target, type):
            if not issubclass(target, nn.Module):
                raise TypeError(
                    f"scopedckpt: checkpointing target #{index} is the class "
                    f"{target.__name__}, which is not an nn.Module subclass. Pass module "
                    "instances, module classes or a (name, module) -> bool predicate."
                )
            classes.append(target)
        elif callable(target):
            if root is None:
                raise ValueError(
                    f"scopedckpt: checkpointing target #{index} is a predicate, which needs "
                    "a model to name modules against: pass "
                    "checkpointing(predicate, root=model)."
                )
            modules.extend(m for name, m in root.named_modules() if target(name, m))
        else:
            raise TypeError(
                f"scopedckpt: checkpointing target #{index} is {article(type(target).__name__)}; "
                "expected an nn.Module, an nn.Module subclass or a (name, module) -> bool "
                "predicate. To turn checkpointing off, pass enabled=False."
            )
    return list({id(m): m for m in modules}.values()), tuple(dict.fromkeys(classes)), saves
