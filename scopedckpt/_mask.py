"""Dropout masks: built from a seed, applied with ATen's arithmetic, kept as one byte.

A scoped dropout call's mask is a pure function of its seed (``rand < 1 - p``
from a per-thread generator reseeded with it), so a recompute, or backward with
``save_mask=False``, rebuilds the same bits without touching any global RNG
state. See :mod:`scopedckpt.functional` for how seeds are drawn and replayed.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._torch_private import scoped_draws

__all__ = ["Mask", "MaskedDropout"]

# SELU's negative saturation, as in ATen's alpha dropout.
_ALPHA = 1.7580993408473766


_GENERATORS = threading.local()


def _mask_generator(device: torch.device) -> torch.Generator:
    """This thread's reusable generator for ``device``; callers reseed it.

    Building a generator per call cost more than the seeding itself; one per
    thread keeps concurrent threads (and the autograd worker) apart.
    """
    cache: dict[torch.device, torch.Generator] | None = getattr(_GENERATORS, "cache", None)
    if cache is None:
        cache = _GENERATORS.cache = {}
    generator = cache.get(device)
    if generator is None:
        generator = cache[device] = torch.Generator(device=device)
    return generator


@dataclass(frozen=True)
class Mask:
    """Everything needed to rebuild one call's mask and its scaling."""

    seed: int
    p: float
    shape: tuple[int, ...]
    device: torch.device
    alpha: bool
    save_mask: bool

    def _uniform(self) -> Tensor:
        """This call's uniform draws: ``rand`` from a generator seeded with ``seed``.

        ``rand`` and a compare run faster on CPU than ``bernoulli_`` (one
        sequential Mersenne Twister pass either way, so the mask does not depend
        on the number of threads) and resolve ``p`` to 2**-24.
        """
        generator = _mask_generator(self.device)
        generator.manual_seed(self.seed)
        with scoped_draws():
            return torch.rand(self.shape, generator=generator, device=self.device)

    def draw(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The keep-mask ``rand < 1 - p`` as 0/1 in ``dtype``, and as bytes to keep
        for backward (``save_mask``) or None.

        Measured on CPU (one thread, 32k elements): the compare in place on the
        float draws takes 5 us and bool-to-float conversion 21 us, so the mask
        is made in float and kept as uint8 (5 us back to float), not as bool.
        """
        unit = self._uniform().lt_(1.0 - self.p)
        kept = unit.to(torch.uint8) if self.save_mask else None
        return (unit if unit.dtype == dtype else unit.to(dtype)), kept

    def unit(self, kept: Tensor | None, dtype: torch.dtype) -> Tensor:
        """The 0/1 mask in ``dtype`` for backward: from the kept bytes, or drawn again."""
        if kept is not None:
            return kept.to(dtype)
        return self.draw(dtype)[0]

    def _alpha_scale(self) -> float:
        """What alpha dropout multiplies kept elements by: ATen's ``a``."""
        return 1.0 / math.sqrt((_ALPHA * _ALPHA * self.p + 1) * (1 - self.p))

    def _noise(self, unit: Tensor) -> Tensor:
        """The mask scaled, in place, with ATen's own arithmetic (``_dropout_impl``).

        Plain dropout divides by ``1 - p`` in the tensor's dtype (``1.0f /
        float(1 - p)`` for float32) rather than multiplying by a rounded
        ``1 / (1 - p)``: the two differ by an ulp for about a quarter of all p,
        and kept values must be torch's bit for bit.
        """
        return unit.mul_(self._alpha_scale()) if self.alpha else unit.div_(1.0 - self.p)

    def apply(self, x: Tensor, unit: Tensor, inplace: bool = False) -> Tensor:
        """``x`` times the noise (plus the shift for alpha dropout); ``unit`` is used up."""
        shift = None
        if self.alpha:
            # ATen's shift: (mask - 1) * alpha * a + alpha * a * p
            a = self._alpha_scale()
            shift = unit.sub(1).mul_(_ALPHA * a).add_(_ALPHA * a * self.p)
        noise = self._noise(unit)
        if inplace:
            out = x.mul_(noise)
        elif noise.shape == x.shape and x.is_contiguous():
            # The noise buffer becomes the output: one allocation, not two (a
            # product is the same bits in either operand order; the layout is
            # the same too, since both are contiguous).
            out = noise.mul_(x)
        else:
            out = x * noise  # channel-wise: the noise broadcasts
        return out if shift is None else out.add_(shift)

    def grad(self, grad: Tensor, kept: Tensor | None) -> Tensor:
        """The input gradient: ``grad`` times the same noise as :meth:`apply`."""
        noise = self._noise(self.unit(kept, grad.dtype))
        if noise.shape == grad.shape and grad.is_contiguous():
            return noise.mul_(grad)  # as in apply: one allocation
        return grad * noise


class MaskedDropout(torch.autograd.Function):
    """``x * noise (+ shift)`` keeping a bool mask or only the seed for backward."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, mask: Mask, inplace: bool) -> Tensor:
        unit, kept = mask.draw(input.dtype)
        if inplace:
            ctx.mark_dirty(input)
        out = mask.apply(input, unit, inplace)
        ctx.mask = mask
        if kept is not None:
            ctx.save_for_backward(kept)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        mask: Mask = ctx.mask
        kept = ctx.saved_tensors[0] if mask.save_mask else None
        return mask.grad(grad, kept), None, None
