"""The versioned mask stream (``_mask.STREAM_VERSION``): the bits a seed gives, pinned
per size band on CPU. A change here changes users' masks between releases: bump
STREAM_VERSION, record the new digests and say so in the CHANGELOG."""

from __future__ import annotations

import hashlib

import pytest
import torch

import scopedckpt
from scopedckpt.layers import _mask

# Under STREAM_VERSION 2, seed 1234: sha256 of the keep-mask's bytes, first 16 hex digits.
GOLDEN = {
    # one draw from the Mersenne Twister (below PIECES_FROM_ELEMENTS)
    (1001, 0.1): "66173e50bf74f636",
    (1001, 0.5): "345ba22e956a9540",
    # two pieces from the Mersenne Twister (PIECES_FROM_ELEMENTS to HASHED_FROM_ELEMENTS)
    (65_537, 0.1): "fb0798032268b83f",
    (65_537, 0.5): "e223ab021191be41",
    # SplitMix64 over each word's index (from HASHED_FROM_ELEMENTS), one and three chunks
    (98_304, 0.1): "0212cc8dddc87e05",
    (98_304, 0.5): "a5db2652a24031f5",
    (131_073, 0.1): "9fb9fc5a38f31771",
    (131_073, 0.5): "73ee588be6d98d3d",
}


def _digest(mask: torch.Tensor) -> str:
    return hashlib.sha256(bytes(mask.flatten().tolist())).hexdigest()[:16]


def test_the_stream_version_is_the_one_the_golden_masks_were_recorded_under() -> None:
    assert _mask.STREAM_VERSION == 2, "record new GOLDEN digests under the new version"
    bands = sorted({numel for numel, _ in GOLDEN})
    assert bands[0] < _mask.PIECES_FROM_ELEMENTS <= bands[1] < _mask.HASHED_FROM_ELEMENTS
    assert _mask.HASHED_FROM_ELEMENTS == bands[2] and "cpu" in _mask.HASHED_DEVICES


@pytest.mark.parametrize(("numel", "p"), list(GOLDEN))
def test_a_seed_keeps_the_same_elements_as_recorded(numel: int, p: float) -> None:
    keep = _mask.Mask(1234, p, (numel,), torch.device("cpu"), False, True).keep()
    assert _digest(keep) == GOLDEN[(numel, p)], (
        f"the mask stream changed for {numel} elements at p={p}: bump "
        "_mask.STREAM_VERSION, record new digests here and add a CHANGELOG line"
    )


def test_a_scoped_dropout_draws_its_seed_and_mask_as_recorded() -> None:
    """End to end: the seed drawn from the default generator, then the mask."""
    torch.manual_seed(0)
    out = scopedckpt.Dropout(0.5)(torch.ones(1001))
    assert _digest(out.ne(0).to(torch.uint8)) == "01acf994b6b32df9"


def test_the_caches_by_p_are_bounded() -> None:
    """A dropout schedule brings a new p every step: the per-p caches must not grow."""
    for step in range(3 * _mask._CACHE_SIZE):
        p = 0.1 + step * 1e-6
        _mask._threshold(p)
        _mask._scale(p, torch.float32)
    assert _mask._threshold.cache_info().currsize <= _mask._CACHE_SIZE
    assert _mask._scale.cache_info().currsize <= _mask._CACHE_SIZE
