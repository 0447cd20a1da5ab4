"""Scoped dropout functions: one seed per call, replayed in recomputes.

The functional counterparts of the scoped dropout layers (and of
:mod:`torch.nn.functional`'s dropouts): the implementation, how seeds are drawn,
recorded and replayed, is in ``_dropout.py``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from .layers._dropout import check_p, scoped_dropout

__all__ = [
    "alpha_dropout",
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "feature_alpha_dropout",
]


class _Dropout(Protocol):
    """The signature of every function here; ``training`` defaults to ``False`` for the
    alpha dropouts, as in :mod:`torch.nn.functional`."""

    def __call__(
        self,
        input: Tensor,
        p: float = 0.5,
        training: bool = ...,
        inplace: bool = False,
        *,
        generator: torch.Generator | None = None,
        save_mask: bool = True,
    ) -> Tensor: ...


# The Example of a docstring that gives ``example``, the shape of the input.
_EXAMPLE = """

    Example
    -------
    >>> import torch
    >>> from scopedckpt import functional as SF
    >>> SF.{name}(torch.ones({shape}), p=0.5{training}).shape
    torch.Size([{shape}])
"""


def _function(name: str, training_default: bool, doc: str, example: str = "") -> _Dropout:
    """The public function ``name``, which checks ``p`` and keys its calls on the tape;
    ``doc`` is its docstring, completed by an Example on ``torch.ones(example)`` if given."""

    def function(
        input: Tensor,
        p: float = 0.5,
        training: bool = training_default,
        inplace: bool = False,
        *,
        generator: torch.Generator | None = None,
        save_mask: bool = True,
    ) -> Tensor:
        p = check_p(p, name)
        return scoped_dropout(name, input, p, training, inplace, generator, save_mask, function)

    if example:
        training = "" if training_default else ", training=True"
        doc += _EXAMPLE.format(name=name, shape=example, training=training)
    function.__name__ = function.__qualname__ = name
    function.__doc__ = doc
    return function


dropout = _function(
    "dropout",
    True,
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``.

    The scoped counterpart of :func:`torch.nn.functional.dropout`: inside a
    checkpoint region the recompute replays this call's mask exactly.

    Parameters
    ----------
    input
        Any tensor.
    p
        Probability of zeroing an element, in ``[0, 1]``.
    training
        Apply dropout only if ``True``; otherwise return ``input``.
    inplace
        Write the result into ``input``.
    generator
        Draw this call's seed from it instead of the default CPU generator.
    save_mask
        Keep a one-byte-per-element mask for backward (default; channel-wise
        dropout keeps its float noise, one value per channel) or only the seed,
        rebuilding the mask in backward.

    Returns
    -------
    Tensor
        The result, same shape and dtype as ``input``.

    Raises
    ------
    ValueError
        If ``p`` is outside ``[0, 1]``.

    Example
    -------
    >>> import torch
    >>> from scopedckpt import functional as SF
    >>> _ = torch.manual_seed(0)
    >>> y = SF.dropout(torch.ones(8), p=0.5)
    >>> sorted(set(y.tolist()))
    [0.0, 2.0]
    """,
)


dropout1d = _function(
    "dropout1d",
    True,
    "Zero whole channels of ``(N, C, L)`` or ``(C, L)`` input; see :func:`dropout`.",
    example="2, 3, 4",
)
dropout2d = _function(
    "dropout2d",
    True,
    """Zero whole channels of ``(N, C, H, W)`` input; see :func:`dropout`.

    Like :func:`torch.nn.functional.dropout2d`, 3D input is taken as
    ``(N, C, L)`` with a warning.""",
    example="2, 3, 4, 4",
)
dropout3d = _function(
    "dropout3d",
    True,
    "Zero whole channels of ``(N, C, D, H, W)`` or ``(C, D, H, W)`` input; see :func:`dropout`.",
    example="2, 3, 2, 2, 2",
)
alpha_dropout = _function(
    "alpha_dropout",
    False,
    "Alpha dropout, which keeps SELU's zero mean and unit variance; see :func:`dropout`.",
    example="4",
)
feature_alpha_dropout = _function(
    "feature_alpha_dropout",
    False,
    "Alpha dropout of whole channels; see :func:`alpha_dropout`.",
    example="2, 3, 4",
)
