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
  exact by itself: compiled with regions is bitwise compiled without on the
  test models (``tests/test_compile.py``) and on HF GPT-2 under a plan
  (``tests/test_real_models.py``), masks and statistics always, where the
  compiled model reproduces itself: inductor lowers an embedding's backward to
  atomic adds on CPU unless ``torch.use_deterministic_algorithms(True)``, and
  without it even two runs without regions differ (``benchmarks/compile_budget.py``).
  That holds only while the region's body traces in one piece, hence the rest
  of this note.
* Every branch asks ``_paths.where()`` or ``_paths.region_path()`` (NOTE
  [ region paths ]), which read ``torch.compiler.is_dynamo_compiling()``, True
  only in code dynamo traces. ``torch.compiler.is_compiling()`` reads a
  process-wide flag that torch 2.13 holds True for a whole compile session, so
  eager code in *another thread* sees True while one thread compiles
  (measured: an eager ``checkpointing`` exit took the traced branch).
* Scopes become a per-thread mirror, ``_paths.MIRROR`` (a
  ``threading.local``): two bools that compiled code reads and dynamo guards
  on, per thread (one graph per value, no recompile per step), the innermost
  block's ``save=`` policy, and a plan's policy of each module by id
  (``planned``: every region of a plan compiles with its own preset, one graph
  per plan).
  ``regions``: this thread is inside an enabled ``checkpointing()`` block; a
  block entered inside a compiled function sets it at trace time. ``eager``:
  this thread runs an eager region frame. A process-wide mirror was tried
  first: another thread's scope then changed it while dynamo traced, and
  dynamo failed with ``SpeculationLogDivergence`` on its restart (measured).
* A compiled call with ``regions`` set and grad enabled wraps each region in
  torch's checkpoint (:func:`compiled_region`); module targets are selected by
  the forward patch :func:`scopedckpt.core._targets.install` put on them (entered
  outside the compiled function) or ``_targets.enter_traced`` puts on them
  (inside).
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

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from ._engine import _region, region_context_fn, region_module
from ._errors import ScopedCkptError
from ._options import BITWISE, DEFAULT_OPTIONS, RegionOptions
from ._paths import EAGER, MIRROR, where
from ._policy import compiled_contexts, traced_policy_info
from ._state import DEFAULT_SCOPE, SCOPE

__all__ = ["compiled_region"]


class _EagerFallback:
    """A region's body: traced as is, or made exact when dynamo runs it eagerly
    (``Path.FALLBACK``)."""

    def __init__(self, fn: Callable[..., Any], owner: object | None, options: RegionOptions):
        self.fn = fn
        self.owner = owner
        self.options = options
        self.contexts: tuple[Any, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if where() is not EAGER:
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
                self.options,
                region_module(self.owner, self.fn),
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
    options: RegionOptions = DEFAULT_OPTIONS,
) -> Any:
    """A region as traced code runs it (``Path.COMPILED``, NOTE [ torch.compile ]).

    ``options.save``: the ``save=`` sequence given to :func:`scopedckpt.checkpoint`,
    or None for the innermost block's policy.
    """
    if options.determinism_check == BITWISE:
        raise ScopedCkptError(
            "scopedckpt: determinism_check='bitwise' cannot apply in compiled code: verify the "
            "model eagerly (the same regions without torch.compile), or pass 'default'.\n"
            "In compiled code a region is torch's checkpoint operator, recomputed inside the "
            "compiled backward, with no recompute to fingerprint (NOTE [ bitwise "
            "verification ])."
        )
    if options.save is not None:
        key, modules = _traced_policy_info(options.save)
    elif MIRROR.planned is not None and id(owner) in MIRROR.planned:
        # A plan's region: its module's policy, as the eager block mirrored it.
        key, modules = MIRROR.planned[id(owner)]
    elif MIRROR.save is None:
        key, modules = -1, False
    else:  # the innermost block's policy, parsed
        key, modules = MIRROR.save.key, MIRROR.save.selects_modules
        options = dataclasses.replace(options, save=MIRROR.save)  # for an eager region below
    if modules or (key >= 0 and options.context_fn is not None):
        # torch's compiled selective checkpointing decides per aten op only, and
        # takes one context_fn: an eager region (a graph break) does both.
        return _eager_policy_region(fn, owner, args, kwargs, options)
    keywords = options.torch_keywords(compiled=True)
    if options.context_fn is not None:
        keywords["context_fn"] = options.context_fn
    elif key >= 0:
        keywords["context_fn"] = functools.partial(compiled_contexts, key)
    body = _EagerFallback(fn, owner, options)
    return torch_checkpoint.checkpoint(
        body,
        *args,
        use_reentrant=False,
        preserve_rng_state=options.preserve_rng_state,
        **keywords,
        **kwargs,
    )


# Parsed at trace time, as constants (NOTE [ torch.compile ]).
_traced_policy_info = torch.compiler.assume_constant_result(traced_policy_info)


@torch.compiler.disable
def _eager_policy_region(
    fn: Callable[..., Any],
    owner: object | None,
    args: Any,
    kwargs: Any,
    options: RegionOptions,
) -> Any:
    """An eager region, body included, for a compiled call whose policy selects
    modules or comes with a context_fn (a graph break). It may run where no
    eager scope is active (a block entered inside the compiled function), so it
    brings one."""
    return _region(fn, owner, args, kwargs, options, scope=SCOPE.get() or DEFAULT_SCOPE)
