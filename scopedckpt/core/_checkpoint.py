"""The public checkpoint functions: regions by call, in eager and compiled code."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from . import _torch_private
from ._contexts import ContextFn
from ._errors import ScopedCkptError
from ._options import DEFAULT_OPTIONS, DETERMINISM_CHECKS, RegionOptions
from ._run import run_region
from ._state import SCOPE, region_name_of

__all__ = ["checkpoint", "checkpoint_sequential"]

R = TypeVar("R")
_DETERMINISM_CHECKS = DETERMINISM_CHECKS


def checkpoint(
    fn: Callable[..., R],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: ContextFn | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    save: Any = None,
    **kwargs: Any,
) -> R:
    """Run ``fn(*args, **kwargs)`` as a checkpoint region inside a scope.

    Inside an enabled :func:`checkpointing` scope, with grad enabled, the
    activations of ``fn`` are not kept for backward; backward recomputes them
    exactly: scoped layers replay their records, other random ops replay the
    default generators' stream, and buffers changed in forward are not changed
    again. Outside a scope, or under ``torch.no_grad()``, it is the plain call
    ``fn(*args, **kwargs)``, so model code can call it unconditionally and the
    caller decides by scoping.

    It takes every keyword of ``torch.utils.checkpoint.checkpoint`` with the
    same meaning; like torch, those named keywords are consumed and every
    other keyword goes to ``fn``.

    Parameters
    ----------
    fn
        The function or module to run.
    *args
        Positional arguments of ``fn``.
    use_reentrant
        ``False`` or unset. Regions are always non-reentrant; ``True`` raises.
    context_fn
        A callable returning two context managers (or dispatch modes), as for
        torch: the first is entered around the first forward, the second
        around every recompute, inside scopedckpt's own (e.g. torch's
        ``create_selective_checkpoint_contexts``).
    determinism_check
        ``"default"`` (torch compares the shapes, dtypes and devices of
        recomputed tensors) or ``"none"``.
    debug
        On a recompute mismatch, torch's error lists the ops of both runs
        (``torch.utils.checkpoint.set_checkpoint_debug_enabled`` works too).
    early_stop
        Stop the recompute once every needed tensor is recomputed (torch's
        default; ``set_checkpoint_early_stop`` overrides it). Exact either way.
    preserve_rng_state
        Replay randomness that no scoped layer draws (``F.dropout``, attention
        ``dropout_p``, ``bernoulli_``, ``torch.rand``...) exactly, by giving
        each recompute the default CPU and accelerator generators' states of
        the first forward (see docs/index.md). ``False`` skips that stash:
        still exact for scoped layers, wrong for any other random op.
    respect_saved_tensors_hooks
        torch >= 2.14: whether what torch's selective checkpointing (a
        ``context_fn`` from ``create_selective_checkpoint_contexts``) keeps goes
        through the surrounding ``saved_tensors_hooks``; passed to torch as is.
        ``None`` (torch's default) on older torch, where a value raises.
        scopedckpt's own ``save=`` keeps its tensors outside the autograd
        graph, as torch's legacy behaviour does.
    save
        Selective saving for this region, overriding the scope's ``save``
        (see :func:`checkpointing`): the op calls it selects keep their outputs
        from the first forward and are not rerun in the recompute. Not a
        torch keyword: a keyword ``save`` of ``fn`` must be passed another way.
    **kwargs
        Keyword arguments of ``fn``.

    Returns
    -------
    Whatever ``fn`` returns.

    Raises
    ------
    TypeError
        If ``fn`` is not callable, or ``respect_saved_tensors_hooks`` is given
        to a torch older than 2.14.
    ValueError
        If ``determinism_check`` is not one torch knows.
    ScopedCkptError
        If ``use_reentrant=True``, or ``save`` selects an op that changes its
        arguments in place or returns a view of one.

    Example
    -------
    >>> import torch, scopedckpt
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), scopedckpt.Dropout(0.5))
    >>> x = torch.randn(3, 4, requires_grad=True)
    >>> with scopedckpt.checkpointing():
    ...     y = scopedckpt.checkpoint(block, x, use_reentrant=False)
    >>> y.sum().backward()   # recomputes block with the same dropout mask
    >>> x.grad.shape
    torch.Size([3, 4])
    """
    if not callable(fn):
        raise TypeError(
            f"scopedckpt: checkpoint expected a callable fn (a function or an "
            f"nn.Module) as its first argument, but got {type(fn).__name__}. "
            "Call it as scopedckpt.checkpoint(fn, *args, **kwargs)."
        )
    if use_reentrant:
        raise ScopedCkptError(reentrant_message(f"checkpoint(use_reentrant=True) of {fn_name(fn)}"))
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"scopedckpt: determinism_check must be one of {_DETERMINISM_CHECKS}, "
            f"but got {determinism_check!r}."
        )
    if respect_saved_tensors_hooks is not None and not _torch_private.PATH.respects_hooks:
        raise TypeError(
            f"scopedckpt: checkpoint(respect_saved_tensors_hooks=...) needs torch >= 2.14; "
            f"torch {torch.__version__} has no such keyword. Leave it unset."
        )
    if (
        preserve_rng_state
        and determinism_check == "default"
        and early_stop
        and not debug
        and context_fn is None
        and save is None
        and respect_saved_tensors_hooks is None
    ):
        options = DEFAULT_OPTIONS  # built once, its torch keywords too
    else:
        options = RegionOptions(
            bool(preserve_rng_state),
            determinism_check,
            bool(early_stop),
            bool(debug),
            context_fn,
            save,
            respect_saved_tensors_hooks,
        )
    return run_region(fn, None, args, kwargs, options)


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[..., Any]],
    segments: int,
    input: Any,
    *,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run a sequence of functions in ``segments`` checkpoint regions, as torch does.

    ``torch.utils.checkpoint.checkpoint_sequential`` with scopedckpt regions:
    ``functions`` (an ``nn.Sequential`` or a list of callables) is split into
    ``segments`` chunks of ``len // segments`` functions; every chunk but the
    last is a region (inside a :func:`checkpointing` scope, with grad
    enabled), the last runs plainly, like torch's.

    Parameters
    ----------
    functions
        The modules or functions to run in order, each taking one input.
    segments
        How many chunks to make.
    input
        The input of the first function.
    use_reentrant
        ``False`` or unset; ``True`` raises as in :func:`checkpoint`.
    **kwargs
        Keywords of :func:`checkpoint` (``preserve_rng_state``,
        ``determinism_check``, ``debug``, ``early_stop``, ``context_fn``,
        ``save``).

    Returns
    -------
    The output of the last function.

    Example
    -------
    >>> import torch, scopedckpt
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> with scopedckpt.checkpointing():
    ...     y = scopedckpt.checkpoint_sequential(model, 2, x, use_reentrant=False)
    >>> y.sum().backward()
    """
    if use_reentrant:
        raise ScopedCkptError(reentrant_message("checkpoint_sequential(use_reentrant=True)"))
    unknown = set(kwargs) - _CHECKPOINT_KEYWORDS
    if unknown:
        raise ValueError(
            f"scopedckpt: checkpoint_sequential got unexpected keyword arguments "
            f"{sorted(unknown)}; it takes {sorted(_CHECKPOINT_KEYWORDS)}."
        )
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    if not 0 < segments:
        raise ValueError(f"scopedckpt: segments must be a positive int, got {segments!r}.")

    def run(start: int, end: int) -> Callable[[Any], Any]:
        def forward(x: Any) -> Any:
            for j in range(start, end + 1):
                x = functions[j](x)
            return x

        return forward

    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(run(start, end), input, **kwargs)
    return run(end + 1, len(functions) - 1)(input)


# The keywords checkpoint_sequential passes on: checkpoint's own, less use_reentrant.
_CHECKPOINT_KEYWORDS = {
    name
    for name, parameter in inspect.signature(checkpoint).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "use_reentrant"
}


def fn_name(fn: object) -> str:
    """A region's function or module for the reentrant refusal (NOTE [ naming ])."""
    return region_name_of(None, fn, SCOPE.get())


def reentrant_message(what: str, why: str = "") -> str:
    """The refusal of reentrant checkpointing: ``what`` asked for it, ``why`` says how."""
    return (
        f"scopedckpt: {what} cannot be exact: pass use_reentrant=False, or leave it unset.\n"
        f"{why}Reentrant checkpointing reruns the region in a nested backward through an "
        "autograd.Function that takes no context_fn, so nothing can replay its random "
        "numbers or keep its buffers from being updated twice. scopedckpt regions are always "
        "non-reentrant, which torch recommends as well."
    )
