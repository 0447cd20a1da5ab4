"""Dropout masks: built from a seed, applied with ATen's arithmetic, kept as one byte.

:func:`masked_dropout` applies one; NOTE [ two formulations ] says which way.

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

__all__ = ["Mask", "MaskedDropout", "masked_dropout"]

# SELU's negative saturation, as in ATen's alpha dropout.
_ALPHA = 1.7580993408473766


_GENERATORS = threading.local()

# ``Mask.scale`` by (p, dtype): computing it costs a kernel and a sync.
_SCALES: dict[tuple[float, torch.dtype], float] = {}

# Element-wise dropout below this many elements runs as plain ATen ops under
# torch's own autograd; from it on, as MaskedDropout (NOTE [ two formulations ]).
NATIVE_BELOW_ELEMENTS = 1 << 15


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

    def keep(self) -> Tensor:
        """The keep-mask ``rand < 1 - p`` as 0/1 floats, compared in place on the
        draws: one definition for every formulation (NOTE [ two formulations ])."""
        return self._uniform().lt_(1.0 - self.p)

    def draw(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The keep-mask ``rand < 1 - p`` as 0/1 in ``dtype``, and as bytes to keep
        for backward (``save_mask``) or None.

        Measured on CPU (one thread, 32k elements): the compare in place on the
        float draws takes 5 us and bool-to-float conversion 21 us, so the mask
        is made in float and kept as uint8 (5 us back to float), not as bool.
        """
        unit = self.keep()
        kept = unit.to(torch.uint8) if self.save_mask else None
        return (unit if unit.dtype == dtype else unit.to(dtype)), kept

    def unit(self, kept: Tensor | None, dtype: torch.dtype) -> Tensor:
        """The 0/1 mask in ``dtype`` for backward: from the kept bytes, or drawn again."""
        if kept is not None:
            return kept.to(dtype)
        return self.draw(dtype)[0]

    def scale(self, dtype: torch.dtype) -> float:
        """What kept elements are multiplied by: ``1 / (1 - p)`` as ATen computes it in ``dtype``.

        The exact value of the noise :meth:`_noise` makes, so that ``x * mask *
        scale`` and ``x * noise`` are the same bits in every dtype.
        """
        key = (self.p, dtype)
        scale = _SCALES.get(key)
        if scale is None:
            scale = _SCALES[key] = float(torch.ones((), dtype=dtype).div_(1.0 - self.p))
        return scale

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


def masked_dropout(input: Tensor, mask: Mask, inplace: bool) -> Tensor:
    """``input`` times ``mask``'s noise, keeping what ``mask.save_mask`` says for backward.

    NOTE [ two formulations ]
    =========================
    The same bits come out of two formulations; which one runs depends only on
    the call, never on the phase, so a recompute takes the branch its forward
    took.

    * Plain ATen ops under torch's autograd, when the mask is kept: channel-wise
      ``x * noise`` (autograd keeps the float noise, one value per channel), or
      element-wise ``x * keep * scale`` with a ``uint8`` ``keep`` (autograd keeps
      those bytes, and ``scale`` as a Python number). No ``autograd.Function``:
      its apply and its Python backward cost ~30 us a call, more than the
      kernels of a 64 x 64 dropout.
    * :class:`MaskedDropout` otherwise: alpha dropout, ``save_mask=False``
      (nothing kept, redrawn in backward) and element-wise masks over
      ``NATIVE_BELOW_ELEMENTS``, where the in-place float ops beat the
      mixed-dtype ``x * keep`` (at 1024 x 1024 on CPU: 145 us against 60).

    ``x * keep * scale`` equals ``x * noise`` bit for bit: ``x * 1`` is ``x``,
    ``x * 0`` is the same signed zero (or NaN) as ``x * 0.0``, and ``scale`` is
    the noise's own value in the input's dtype (:meth:`Mask.scale`); the same
    holds for the gradients. tests/test_layers.py checks both against each other.
    """
    if not mask.save_mask or mask.alpha:
        return MaskedDropout.apply(input, mask, inplace)
    if mask.shape != tuple(input.shape):  # channel-wise: the noise broadcasts
        unit = mask.keep()
        noise = mask._noise(unit if unit.dtype == input.dtype else unit.to(input.dtype))
        return input.mul_(noise) if inplace else input * noise
    if input.numel() >= NATIVE_BELOW_ELEMENTS:
        return MaskedDropout.apply(input, mask, inplace)
    keep = mask.keep().to(torch.uint8)
    out = input.mul_(keep) if inplace else input * keep
    return out.mul_(mask.scale(input.dtype))
