"""Regions in compiled code: torch's checkpoint operator, exact by itself.

NOTE [ torch.compile ]
======================
Compiled code can use none of the eager machinery: dynamo graph-breaks on
``ContextVar.get``/``set`` (torch 2.13) and rejects a custom ``context_fn``.
It does not need it either:

* Called from compiled code, ``torch.utils.checkpoint.checkpoint`` with
  ``use_reentrant=False`` and no ``context_fn`` becomes the
  ``tag_activation_checkpoint`` higher-order op. Its forward graph updates
  batch-norm running statistics once; its backward graph recomputes from the
  random seeds inductor saved, without the update. So a compiled region is
  exact by itself: compiled with regions is bitwise compiled without
  (``tests/test_compile.py``). That holds only while the region's body traces
  in one piece, hence the rest of this note.
* Every branch asks ``torch.compiler.is_dynamo_compiling()``, which is True
  only in code dynamo traces. ``torch.compiler.is_compiling()`` reads a
  process-wide flag that torch 2.13 holds True for a whole compile session, so
  eager code in *another thread* sees True while one thread compiles
  (measured: an eager ``checkpointing`` exit took the traced branch).
* Scopes become a per-thread mirror, ``_state.MIRROR`` (a
  ``threading.local``): two bools that compiled code reads and dynamo guards
  on, per thread (one graph per value, no recompile per step).
  ``regions``: this thread is inside an enabled ``checkpointing()`` block; a
  block entered inside a compiled function sets it at trace time. ``eager``:
  this thread runs an eager region frame. A process-wide mirror was tried
  first: another thread's scope then changed it while dynamo traced, and
  dynamo failed with ``SpeculationLogDivergence`` on its restart (measured).
* A compiled call with ``regions`` set and grad enabled wraps each region in
  torch's checkpoint (:func:`compiled_region`); module targets are selected by
  the forward patch :func:`scopedckpt._targets.install` put on them (entered
  outside the compiled function) or :func:`enter_traced` puts on them (inside).
* Scoped layers trace as torch's own ops (``torch.dropout``,
  ``F.batch_norm``): their masks come from inductor's generator, seeded from
  torch's default one, so ``torch.manual_seed`` reproduces a compiled run but
  compiled and eager masks differ. A dropout with its own ``generator=`` runs
  eagerly (a graph break): a ``torch.Generator`` cannot enter compiled code.
* With ``eager`` set, compiled code may be running inside an eager region,
  whose recompute would rerun the compiled graph and update its buffers a
  second time. Regions and scoped layers then take the eager, context-reading
  path (graph breaks, exact), like before compile support existed.
* A graph break inside a region's body makes dynamo run torch's checkpoint
  eagerly, with no ``context_fn``: batch norm would be updated twice. The
  body is therefore an :class:`_EagerFallback`, which in that case enters the
  region's frames itself (its first call is the first forward, every later
  call a recompute) and is exact, at eager speed.
* Threads and tasks: the mirror follows the thread, not the context. A
  thread started with ``contextvars.copy_context().run`` sees its creator's
  scope in eager code but not in compiled code; asyncio tasks sharing a
  thread share its mirror. Either way results stay exact (a compiled region
  is exact by itself); only the memory a compiled call keeps changes
  (docs/distributed.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from ._engine import ContextFn, _region, region_context_fn, region_outside_dynamo
from ._policy import SavePolicy, as_policy, compiled_contexts, traced_policy_info
from ._state import DEFAULT_SCOPE, MIRROR, SCOPE

__all__ = ["compiled_region", "enter_traced", "exit_traced"]


class _EagerFallback:
    """A region's body: traced as is, or made exact when dynamo runs it eagerly."""

    def __init__(
        self,
        fn: Callable[..., Any],
        owner: object | None,
        preserve_rng_state: bool,
        save: Any = None,
    ):
        self.fn = fn
        self.owner = owner
        self.preserve_rng_state = preserve_rng_state
        self.save = save
        self.contexts: tuple[Any, Any] | None = None
        self.run = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return self.fn(*args, **kwargs)
        return self._eager(args, kwargs)

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # torch's eager checkpoint calls its body once for the first forward
        # and once per recompute, each time on the same arguments.
        if self.contexts is None:
            scope = SCOPE.get() or DEFAULT_SCOPE
            label = self.owner if self.owner is not None else self.fn
            self.run, contexts = region_context_fn(
                self.fn,
                self.owner,
                label,
                scope,
                args,
                kwargs,
                preserve_rng_state=self.preserve_rng_state,
                context_fn=None,
                save=as_policy(self.save),
            )
            self.contexts = contexts()
            with self.contexts[0]:
                return self.run(*args, **kwargs)
        with self.contexts[1]:
            return self.run(*args, **kwargs)


def compiled_region(
    fn: Callable[..., Any],
    owner: object | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    early_stop: bool = True,
    debug: bool = False,
    context_fn: ContextFn | None = None,
    save: Any = None,
    respect_saved_tensors_hooks: bool | None = None,
) -> Any:
    """A region as compiled code runs it (NOTE [ torch.compile ]).

    ``save``: the ``save=`` sequence given to :func:`scopedckpt.checkpoint`, or
    None for the innermost scope's policy.
    """
    eager: dict[str, Any] = dict(  # for the eager regions below
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        early_stop=early_stop,
        debug=debug,
        context_fn=context_fn,
        save=save,
        respect_saved_tensors_hooks=respect_saved_tensors_hooks,
    )
    if MIRROR.eager:
        return region_outside_dynamo(fn, owner, args, kwargs, **eager)
    if not MIRROR.regions or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if save is None:
        save = eager["save"] = MIRROR.save  # a parsed policy (or None)
        key, modules = (-1, False) if save is None else (save.key, save.selects_modules)
    else:
        key, modules = _traced_policy_info(save)
    if modules or (key >= 0 and context_fn is not None):
        # torch's compiled selective checkpointing decides per aten op only, and
        # takes one context_fn: an eager region (a graph break) does both.
        return _eager_policy_region(fn, owner, args, kwargs, **eager)
    options: dict[str, Any] = {}
    # Only what differs from torch's defaults: dynamo handles fewer keywords.
    if determinism_check != "default":
        options["determinism_check"] = determinism_check
    if debug:
        options["debug"] = debug
    if respect_saved_tensors_hooks is not None:
        options["respect_saved_tensors_hooks"] = respect_saved_tensors_hooks
    if context_fn is not None:
        options["context_fn"] = context_fn
    elif key >= 0:
        options["context_fn"] = functools.partial(compiled_contexts, key)
    body = _EagerFallback(fn, owner, preserve_rng_state, save)
    return torch_checkpoint.checkpoint(
        body,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        **options,
        **kwargs,
    )


# Parsed at trace time, as constants (NOTE [ torch.compile ]).
_traced_policy_info = torch.compiler.assume_constant_result(traced_policy_info)


@torch.compiler.disable
def _eager_policy_region(
    fn: Callable[..., Any], owner: object | None, args: Any, kwargs: Any, **options: Any
) -> Any:
    """An eager region, body included, for a compiled call whose policy selects
    modules or comes with a context_fn (a graph break). It may run where no
    eager scope is active (a block entered inside the compiled function), so it
    brings one."""
    return _region(fn, owner, args, kwargs, scope=SCOPE.get() or DEFAULT_SCOPE, **options)


def _traced_forward(module: nn.Module, previous: Any) -> Callable[..., Any]:
    inner = previous if previous is not None else functools.partial(type(module).forward, module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return compiled_region(inner, module, args, kwargs)

    return forward


def enter_traced(
    modules: list[nn.Module], enabled: bool, save: SavePolicy | None
) -> tuple[tuple[bool, Any], list[tuple[nn.Module, Any]]]:
    """A ``checkpointing()`` block entered while dynamo traces: set the mirror and
    patch the targets for the trace; returns what :func:`exit_traced` puts back.

    Dynamo records both as side effects of the traced function and replays
    only their net result (nothing) when the compiled code runs.
    """
    previous = MIRROR.regions, MIRROR.save
    MIRROR.regions = enabled
    if save is not None:
        MIRROR.save = save
    patched = []
    for module in modules:
        existing = module.__dict__.get("forward")
        if getattr(existing, "__scopedckpt_patch__", False):
            continue  # patched by a block entered outside the compiled function
        module.__dict__["forward"] = _traced_forward(module, existing)
        patched.append((module, existing))
    return previous, patched


def exit_traced(previous: tuple[bool, Any], patched: list[tuple[nn.Module, Any]]) -> None:
    """Undo :func:`enter_traced`."""
    MIRROR.regions, MIRROR.save = previous
    for module, existing in patched:
        if existing is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = existing
