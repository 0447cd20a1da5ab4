"""The tape's public face: the phase code runs in, and values decided once per first
forward and replayed in every recompute (NOTE [ tape ] in ``_state.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ._state import FORWARD, FRAME, NONE, RECOMPUTE, Phase, Record

__all__ = ["is_recomputing", "phase", "replay", "tape_value"]

T = TypeVar("T")


def tape_value(kind: str, owner: object, decide: Callable[[], T]) -> tuple[T, Phase]:
    """Decide once per first forward, replay in every recompute.

    Outside a region ``decide()`` is called and nothing is recorded. Inside a
    region's first forward ``decide()`` is called and its value appended to the
    tape. In a recompute the recorded value is returned and ``decide`` is not
    called (so no random numbers are drawn and no state is touched).
    """
    frame = FRAME.get()
    if frame is None:
        return decide(), NONE
    if frame.phase is RECOMPUTE:
        return frame.take(kind, id(owner), owner).value, RECOMPUTE
    value = decide()
    frame.tape.records.append(Record(kind, id(owner), owner, value))
    return value, FORWARD


def phase() -> Phase:
    """Return the checkpoint phase of the code that calls it.

    The answer is right inside the backward recompute too, although that runs
    inside ``loss.backward()`` after the ``with checkpointing()`` block exited
    and, on CUDA, on an autograd worker thread: the recompute sets it itself.

    Returns
    -------
    Phase
        ``NONE`` outside regions, ``FORWARD`` in a region's first
        forward, ``RECOMPUTE`` while backward recomputes a region.

    Example
    -------
    >>> import torch, scopedckpt
    >>> seen = []
    >>> def block(x):
    ...     seen.append(scopedckpt.phase())
    ...     return x.sin()
    >>> x = torch.ones(2, requires_grad=True)
    >>> with scopedckpt.checkpointing():
    ...     y = scopedckpt.checkpoint(block, x)
    >>> y.sum().backward()
    >>> [p.name for p in seen]
    ['FORWARD', 'RECOMPUTE']
    """
    frame = FRAME.get()
    return NONE if frame is None else frame.phase


def is_recomputing() -> bool:
    """Return whether the calling code runs in a backward recompute.

    Example
    -------
    >>> import scopedckpt
    >>> scopedckpt.is_recomputing()
    False
    """
    return phase() is RECOMPUTE


def replay(owner: object, decide: Callable[[], T]) -> T:
    """Decide in a region's first forward; get the same value back in every recompute.

    The extension point for your own random or stateful layers: whatever
    ``decide()`` returns in the first forward of a checkpoint region (a token
    permutation, a Python-random choice, a step count) is recorded on the
    region's tape, and each backward recompute gets the recorded value without
    calling ``decide`` again. Calls are checked like scoped layers' calls: a
    recompute that calls ``replay`` for another owner, or more often, than the
    first forward raises :class:`scopedckpt.ScopedCkptError`. Outside regions
    it just returns ``decide()``.

    Parameters
    ----------
    owner
        The object deciding, usually the layer (``self``): named in errors and
        checked on replay.
    decide
        Called once per first forward (and outside regions at every call).

    Returns
    -------
    The value ``decide()`` returned in the region's first forward.

    Example
    -------
    A layer that keeps a random subset of tokens, chosen with Python's
    ``random`` (which no stash rewinds):

    >>> import random, torch, scopedckpt
    >>> class TokenDrop(torch.nn.Module):
    ...     def forward(self, x):                       # x: (batch, tokens, dim)
    ...         n = x.shape[1]
    ...         keep = scopedckpt.replay(self, lambda: sorted(random.sample(range(n), n // 2)))
    ...         return x[:, keep]
    >>> layer, x = TokenDrop(), torch.randn(2, 6, 4, requires_grad=True)
    >>> with scopedckpt.checkpointing():
    ...     y = scopedckpt.checkpoint(layer, x)
    >>> y.square().sum().backward()   # the recompute keeps the same tokens
    >>> int((x.grad.abs().sum((0, 2)) > 0).sum())
    3
    """
    return tape_value("decision", owner, decide)[0]
