"""Hypothesis strategies for property tests of your own models.

Needs Hypothesis: ``pip install 'scopedckpt[testing]'``.

Example
-------
>>> import torch, scopedckpt
>>> from hypothesis import given, settings
>>> from scopedckpt.testing import assert_checkpoint_equivalent
>>> from scopedckpt.testing import strategies as sst
>>> model = scopedckpt.convert(torch.nn.Sequential(
...     torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.2)))
>>> @settings(max_examples=5, deadline=None)
... @given(x=sst.batches((4,)), targets=sst.regions(model), seed=sst.seeds())
... def test_exact(x, targets, seed):
...     assert_checkpoint_equivalent(model, x, targets=targets, seed=seed)
>>> test_exact()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

try:
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - exercised only without hypothesis
    raise ImportError(
        "scopedckpt: scopedckpt.testing.strategies needs Hypothesis; install it with "
        "pip install 'scopedckpt[testing]'."
    ) from error

__all__ = ["batches", "regions", "seeds", "tensors"]


def seeds() -> st.SearchStrategy[int]:
    """Seeds for ``torch.manual_seed`` and :func:`assert_checkpoint_equivalent`.

    Example
    -------
    >>> from hypothesis import find
    >>> from scopedckpt.testing.strategies import seeds
    >>> 0 <= find(seeds(), lambda s: s > 10) < 2**32
    True
    """
    return st.integers(0, 2**32 - 1)


def tensors(
    shape: Sequence[int] | st.SearchStrategy[tuple[int, ...]],
    *,
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
) -> st.SearchStrategy[Tensor]:
    """Normal random tensors of ``shape`` (or shapes drawn from a strategy).

    Values come from a drawn seed, so examples are cheap, shrink by seed and
    replay exactly.

    Example
    -------
    >>> from hypothesis import find
    >>> from scopedckpt.testing.strategies import tensors
    >>> find(tensors((2, 3)), lambda t: True).shape
    torch.Size([2, 3])
    """
    shapes = shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape))

    def build(args: tuple[tuple[int, ...], int]) -> Tensor:
        size, seed = args
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(size, generator=generator, dtype=torch.float64) * scale).to(dtype)

    return st.tuples(shapes, seeds()).map(build)


def batches(
    feature_shape: Sequence[int],
    *,
    min_batch: int = 2,
    max_batch: int = 8,
    dtype: torch.dtype = torch.float32,
) -> st.SearchStrategy[Tensor]:
    """Input batches ``(N, *feature_shape)`` with a random batch size ``N``.

    ``min_batch`` defaults to 2 since batch norm in training needs more than
    one value per channel.

    Example
    -------
    >>> from hypothesis import find
    >>> from scopedckpt.testing.strategies import batches
    >>> x = find(batches((3, 8)), lambda t: t.shape[0] > 3)
    >>> x.shape[1:], 2 <= x.shape[0] <= 8
    (torch.Size([3, 8]), True)
    """
    if min_batch < 1 or max_batch < min_batch:
        raise ValueError(
            f"scopedckpt: batches needs 1 <= min_batch <= max_batch, got min_batch={min_batch}, "
            f"max_batch={max_batch}."
        )
    feature = tuple(feature_shape)
    shapes = st.integers(min_batch, max_batch).map(lambda n: (n, *feature))
    return tensors(shapes, dtype=dtype)


def regions(
    model: nn.Module, *, min_size: int = 1, include_root: bool = False
) -> st.SearchStrategy[list[nn.Module]]:
    """Random choices of submodules of ``model`` to make checkpoint regions.

    Pass the result as ``targets`` to :func:`assert_checkpoint_equivalent` or
    to :func:`scopedckpt.checkpointing`. Chosen modules may nest.

    Example
    -------
    >>> import torch
    >>> from hypothesis import find
    >>> from scopedckpt.testing.strategies import regions
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> [type(m).__name__ for m in find(regions(model), lambda r: len(r) == 2)]
    ['Linear', 'ReLU']
    """
    modules = [m for name, m in model.named_modules() if name or include_root]
    if not modules:
        raise ValueError(
            "scopedckpt: regions(model) found no submodules to choose from; pass "
            "include_root=True to checkpoint the whole model."
        )
    return st.lists(
        st.sampled_from(range(len(modules))), min_size=min_size, max_size=len(modules), unique=True
    ).map(lambda picks: [modules[i] for i in sorted(picks)])
