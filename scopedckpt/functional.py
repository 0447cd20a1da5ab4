"""Scoped dropout functions: one seed per call, replayed in recomputes.

The functional counterparts of the scoped dropout layers (and of
:mod:`torch.nn.functional`'s dropouts): the implementation, how seeds are drawn,
recorded and replayed, is in ``_dropout.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .layers._dropout import (
    check_p,
    impl_alpha_dropout,
    impl_dropout,
    impl_dropout1d,
    impl_dropout2d,
    impl_dropout3d,
    impl_feature_alpha_dropout,
)

__all__ = [
    "alpha_dropout",
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "feature_alpha_dropout",
]


def dropout(
    input: Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    generator: torch.Generator | None = None,
    save_mask: bool = True,
) -> Tensor:
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
    """
    p = check_p(p, "dropout")
    return impl_dropout(input, p, training, inplace, generator, save_mask, dropout)


def dropout1d(
    input: Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    generator: torch.Generator | None = None,
    save_mask: bool = True,
) -> Tensor:
    """Zero whole channels of ``(N, C, L)`` or ``(C, L)`` input; see :func:`dropout`.

    Example
    -------
    >>> import torch
    >>> from scopedckpt import functional as SF
    >>> SF.dropout1d(torch.ones(2, 3, 4), p=0.5).shape
    torch.Size([2, 3, 4])
    """
    p = check_p(p, "dropout1d")
    return impl_dropout1d(input, p, training, inplace, generator, save_mask, dropout1d)


def dropout2d(
    input: Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    generator: torch.Generator | None = None,
    save_mask: bool = True,
) -> Tensor:
    """Zero whole channels of ``(N, C, H, W)`` input; see :func:`dropout`.

    Like :func:`torch.nn.functional.dropout2d`, 3D input is taken as
    ``(N, C, L)`` with a warning.

    Example
    -------
    >>> import torch
    >>> from scopedckpt import functional as SF
    >>> SF.dropout2d(torch.ones(2, 3, 4, 4), p=0.5).shape
    torch.Size([2, 3, 4, 4])
    """
    p = check_p(p, "dropout2d")
    return impl_dropout2d(input, p, training, inplace, generator, save_mask, dropout2d)


def dropout3d(
    input: Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    generator: torch.Generator | None = None,
    save_mask: bool = True,
) -> Tensor:
    """Zero whole channels of ``(N, C, D, H, W)`` or ``(C, D, H, W)`` input; see :func:`dropout`.

    Example
    -------
    >>> import torch
    >>> from scopedckpt import functional as SF
    >>> SF.dropout3d(torch.ones(2, 3, 2, 2, 2), p=0.5).shape
    torch.Size([2, 3, 2, 2, 2])
    """
    p = check_p(p, "dropout3d")
    return impl_dropout3d(input, p, training, inplace, generator, save_mask, dropout3d)


def alpha_dropout(
    input: Tensor,
    p: float = 0.5,
    training: bool = False,
    inplace: bool = False,
    *,
    generator: torch.Generator | None = None,
    save_mask: bool = True,
) -> Tensor:
    """Alpha dropout, which keeps SELU's zero mean and unit variance; see :func:`dropout`.

    Example
    -------
    >>> import torch
    >>> from scopedckpt import functional as SF
    >>> SF.alpha_dropout(torch.ones(4), p=0.5, training=True).shape
    torch.Size([4])
    """
    p = check_p(p, "alpha_dropout")
    return impl_alpha_dropout(input, p, training, inplace, generator, save_mask, alpha_dropout)


def feature_alpha_dropout(
    input: Tensor,
    p: float = 0.5,
    training: bool = False,
    inplace: bool = False,
    *,
    generator: torch.Generator | None = None,
    save_mask: bool = True,
) -> Tensor:
    """Alpha dropout of whole channels; see :func:`alpha_dropout`.

    Example
    -------
    >>> import torch
    >>> from scopedckpt import functional as SF
    >>> SF.feature_alpha_dropout(torch.ones(2, 3, 4), p=0.5, training=True).shape
    torch.Size([2, 3, 4])
    """
    p = check_p(p, "feature_alpha_dropout")
    return impl_feature_alpha_dropout(
        input, p, training, inplace, generator, save_mask, feature_alpha_dropout
    )
