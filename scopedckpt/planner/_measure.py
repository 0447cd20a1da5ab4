"""``scopedckpt.measure_peak()``: a step's peak memory in the planner's unit, so that any
plan's promise (``peak <= plan.budget``) can be checked on the step a user runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._live import LiveBytes

__all__ = ["measure_peak"]


def measure_peak(step: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run ``step(*args, **kwargs)`` once and return its peak memory in bytes, as
    :func:`scopedckpt.plan` counts it.

    The unit is a plan's (NOTE [ live bytes ] in ``scopedckpt/planner/_live.py``): the
    bytes of the tensors the step's ops create, at the moment most of them are alive,
    above what was allocated before the step (parameters, optimizer state, inputs, and
    gradients that already exist are not in it). That is what
    ``torch.cuda.max_memory_allocated()`` shows minus what was allocated before the
    step, less the CUDA allocator's rounding and caching, the backward's and every
    recompute's ops included (tested on CPU; on CUDA, NOTE [ live bytes ] says what is
    read in torch's source but not yet measured). The step runs as it would without the
    measurement: the counter only watches the ops go by, so values, gradients and
    random streams are bit for bit the same.

    Parameters
    ----------
    step
        A training step: a callable that runs the forward and the backward, e.g.
        ``lambda: model(x).loss.backward()``. Entering ``checkpointing(plan)`` inside
        it or around the call gives the peak under the plan.
    *args, **kwargs
        Passed to ``step``.

    Returns
    -------
    int
        The peak in bytes; ``step``'s own return value is dropped.

    Example
    -------
    >>> import torch, scopedckpt
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(
    ...     torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)])
    >>> x = torch.randn(512, 64)
    >>> plan = scopedckpt.plan(model, x, budget=0.75)
    >>> with scopedckpt.checkpointing(plan):
    ...     peak = scopedckpt.measure_peak(lambda: model(x).sum().backward())
    >>> peak <= plan.budget
    True
    """
    if not callable(step):
        raise TypeError(
            f"scopedckpt: measure_peak() takes the step to run, a callable, and got "
            f"{type(step).__name__}. Pass a function that runs the forward and the "
            "backward, e.g. measure_peak(lambda: model(x).sum().backward())."
        )
    with LiveBytes() as counter:
        step(*args, **kwargs)
    return counter.peak
