"""What a fingerprint computes of a tensor: sums of its bit patterns, a sample of its
values, and how two samples differ, in words (NOTE [ bitwise verification ] in
``_verify.py``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["SAMPLE", "differences", "sample", "sums"]

_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Values a fingerprint keeps of its tensor, at evenly spaced positions (all if fewer).
SAMPLE = 64


def _positions(shape: tuple[int, ...], device: torch.device) -> tuple[Tensor, ...]:
    """The indices of ``SAMPLE`` evenly spaced elements of a tensor of ``shape``: made at
    each call and freed with the sample (a cache would hold them past the step, where a
    plan's budget does not count them)."""
    flat = torch.linspace(0, math.prod(shape) - 1, SAMPLE, device=device).round().long()
    return torch.unravel_index(flat, shape)


def sample(x: Tensor) -> Tensor:
    """``SAMPLE`` values of ``x`` at evenly spaced positions, or all of them (flat)."""
    x = x.detach()
    if x.numel() <= SAMPLE:
        return x.reshape(-1).clone()
    return x[_positions(tuple(x.shape), x.device)]  # gathers, copying no more than that


def differences(first: Tensor | None, recomputed: Tensor | None, numel: int) -> str:
    """How many of the sampled values differ, and by how much, in words."""
    if first is None or recomputed is None or first.shape != recomputed.shape:
        return ""
    if first.dtype == torch.bool:
        first, recomputed = first.byte(), recomputed.byte()
    if first.is_complex():  # (n, 2): an element differs where either part does
        first, recomputed = torch.view_as_real(first), torch.view_as_real(recomputed)
    bits = _INTEGERS[first.element_size()]
    differ = first.view(bits) != recomputed.view(bits)
    delta = (first.double() - recomputed.double()).abs().nan_to_num(nan=math.inf)
    if differ.dim() > 1:
        differ, delta = differ.any(-1), delta.amax(-1)
    count = int(differ.sum())
    if count == 0:
        if numel <= SAMPLE:
            return ""
        return (
            f"None of the {SAMPLE} values sampled at evenly spaced positions differ: fewer "
            f"than about 1 in {SAMPLE} of its {numel} values do. "
        )
    largest = float(delta.max())
    first_at = int(differ.nonzero()[0, 0])
    if numel > SAMPLE:  # the sample's position in the flattened tensor
        first_at = round(first_at * (numel - 1) / (SAMPLE - 1))
    verb = "differs" if count == 1 else "differ"
    if numel <= SAMPLE:
        counted = f"{count} of its {numel} values {verb}"
    else:
        counted = (
            f"{count} of the {SAMPLE} values sampled at evenly spaced positions {verb} "
            f"(about {count / SAMPLE:.0%} of its {numel} values)"
        )
    return f"{counted}, by up to {largest:.6g}; the first at flat index {first_at}. "


def sums(x: Tensor) -> Tensor:
    """The two int64 sums of NOTE [ bitwise verification ]."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    bits = x.view(_INTEGERS[x.element_size()]) if x.dtype != torch.bool else x.byte()
    if bits.dim() < 2:
        bits = bits.reshape(1, -1)
    # The one pass over x. Row sums wrap modulo 2**32 (int32 accumulates three times
    # faster than int64 on CPU); one element changing its bits by less than 2**32
    # still changes its row's sum.
    accumulate = torch.int64 if bits.element_size() == 8 else torch.int32
    rows = bits.sum(dim=-1, dtype=accumulate).reshape(-1).to(torch.int64)
    # The row-weighted sum, sum over i of i * rows[i] (i from 1), as the sum of the suffix
    # sums: the same int64 value modulo 2**64, with no weights kept between calls.
    return torch.stack([rows.sum(), rows.flip(0).cumsum(0).sum()])
