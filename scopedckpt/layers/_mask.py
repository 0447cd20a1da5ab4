"""Dropout masks: built from a seed, applied with ATen's arithmetic, kept as one byte.

:func:`masked_dropout` applies one; NOTE [ two formulations ] says which way.

A scoped dropout call's mask is a pure function of its seed (NOTE [ mask bits ]:
32 random bits per element from a per-thread generator reseeded with it,
compared with a threshold), so a recompute, or backward with
``save_mask=False``, rebuilds the same bits without touching any global RNG
state. See :mod:`scopedckpt.functional` for how seeds are drawn and replayed.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core._own_ops import aside
from ..mechanisms._generators import OWN_GENERATORS
from ..mechanisms._strict import scoped_draws

__all__ = ["STREAM_VERSION", "Mask", "MaskedDropout", "masked_dropout"]

# SELU's negative saturation, as in ATen's alpha dropout.
_ALPHA = 1.7580993408473766


_GENERATORS = threading.local()

# The version of the mask stream: which elements a (seed, p, shape, device) keeps.
# It changes, with a CHANGELOG line, whenever any size band's bits change (the
# constants below decide the bands); tests/test_layers.py pins each band's bits
# under this version (golden masks), so that tuning a constant cannot silently
# change users' masks. 1: torch.rand; 2: 32-bit words, pieces, hashed CPU bits.
STREAM_VERSION = 2

# Caches by p: a dropout schedule brings a new p every step, so they are bounded.
_CACHE_SIZE = 1024

# Element-wise dropout below this many elements runs as plain ATen ops under
# torch's own autograd; from it on, as MaskedDropout, except in recomputes
# (NOTE [ two formulations ]).
NATIVE_BELOW_ELEMENTS = 1 << 15

# Masks from this many elements on draw their bits in two pieces (NOTE [ mask
# bits ]). Below it the draw holds 1 byte per element more than torch's noise,
# at most 64 KiB, and the second piece would cost more: 14 % of the draw at
# 32,768 elements.
PIECES_FROM_ELEMENTS = 1 << 16

# Masks from this many elements on, on these devices, take their bits from a
# counter-based hash (NOTE [ hashed bits ]) instead of the device's generator.
HASHED_FROM_ELEMENTS = 3 << 15  # 98,304
HASHED_DEVICES = frozenset({"cpu"})

# The most words hashed at once: two int64 buffers of 256 KiB each.
_HASH_CHUNK_WORDS = 1 << 15

# SplitMix64's increment and multipliers, as signed int64 (what torch's int64
# arithmetic takes): 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB.
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


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
        OWN_GENERATORS.add(generator)  # explicit-generator replay leaves it alone
    return generator


def _random_words(words: Tensor, generator: torch.Generator) -> Tensor:
    """Fill ``int64`` words with all 64 random bits each (without a range, 63)."""
    return words.random_(-(1 << 63), None, generator=generator)


def _signed64(value: int) -> int:
    """``value`` modulo 2**64, as the signed int64 with the same bits."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _hashed_keep(seed: int, threshold: int, keep: Tensor) -> None:
    """Fill the flat ``bool`` tensor ``keep`` from SplitMix64 words.

    NOTE [ hashed bits ]
    ====================
    On CPU, masks from ``HASHED_FROM_ELEMENTS`` on take their 64-bit words from
    SplitMix64 instead of the Mersenne Twister: word ``i`` is SplitMix64's
    mixer applied to ``seed + i * gamma (mod 2**64)``, as Java's
    ``SplittableRandom`` computes its outputs (a 64-bit Weyl sequence through
    two xorshift-multiply rounds, which Steele, Lea and Flood (2014) report
    passes BigCrush). Each word gives two elements their 32 bits, compared with
    the threshold as in NOTE [ mask bits ].

    Why: the Mersenne Twister runs sequentially, one element after another, and
    on CPU its cost per element more than doubles past 65,536 elements; the
    hash is fifteen element-wise ATen ops per chunk (integer multiply, shift,
    mask, xor), one cost per element at every size, which undercuts the
    Twister's from ``HASHED_FROM_ELEMENTS`` on. Each word is a pure function of
    the seed and its index, so the chunks and the thread count cannot change
    the bits. A chunk is a quarter of the words, at most ``_HASH_CHUNK_WORDS``
    (two 256 KiB buffers): the draw holds at most 3 bytes per element, as the
    pieces below do, under the 4 of torch's noise.

    Seeds are drawn uniformly from [0, 2**62): two calls' words overlap only if
    their seeds differ by ``k * gamma`` for some ``k`` below the mask's word
    count, for 2**20 words a chance of at most 2**-41. The int64 multiplies wrap
    modulo 2**64, as torch's integer arithmetic does on CPU;
    tests/test_layers.py checks the words against a pure-Python SplitMix64, so
    a torch that stopped wrapping would fail there, not draw other masks. On
    CUDA the device's own Philox draw is one kernel where this is fifteen, so
    ``HASHED_DEVICES`` is the CPU alone.
    """
    numel = keep.numel()
    words = (numel + 1) // 2
    chunk = min(_HASH_CHUNK_WORDS, -(-words // 4))  # a quarter of the words at most
    z = torch.empty((chunk,), dtype=torch.int64, device=keep.device)
    t = torch.empty_like(z)
    for start in range(0, words, chunk):
        n = min(chunk, words - start)
        zc, tc = z[:n], t[:n]
        # The Weyl sequence seed + i * gamma (mod 2**64), then SplitMix64's mixer;
        # >> is arithmetic on int64, so each shift is masked to a logical one.
        torch.arange(start, start + n, out=zc)
        zc.mul_(_GAMMA).add_(_signed64(seed))
        for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
            torch.bitwise_right_shift(zc, shift, out=tc)
            zc.bitwise_xor_(tc.bitwise_and_((1 << (64 - shift)) - 1))
            if multiplier is not None:
                zc.mul_(multiplier)
        first = 2 * start
        last = min(numel, first + 2 * n)
        torch.lt(zc.view(torch.int32)[: last - first], threshold, out=keep[first:last])


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _threshold(p: float) -> int:
    """The signed 32-bit value a draw must be below for its element to be kept.

    NOTE [ mask bits ]
    ==================
    An element is kept when its 32 random bits, read as a signed ``int32``
    (uniform over [-2**31, 2**31)), are below ``K - 2**31`` with ``K =
    round((1 - p) * 2**32)``: probability ``K / 2**32``, ``1 - p`` to within
    2**-33 (at most 2**32 - 1, so that the threshold fits in an ``int32``).

    The bits come from one ``random_`` over ``int64`` words, all 64 bits of
    each (two Mersenne Twister outputs on CPU), viewed as ``int32``: on CPU one
    sequential pass, so the mask does not depend on the number of threads.
    Measured on CPU, one thread, 32,768 elements: 89 us against 152 us for
    ``torch.rand`` (which spends one 32-bit output per element on 24 bits) and
    314 us for ``bernoulli_``. Which elements are kept is not what
    ``nn.Dropout`` would draw (it never was: the mask has its own generator);
    the kept values are torch's bit for bit.

    On CPU, from ``HASHED_FROM_ELEMENTS`` on, the words come from a
    counter-based hash instead (NOTE [ hashed bits ]), faster at those sizes;
    the compare is the same.

    From ``PIECES_FROM_ELEMENTS`` on, the words are drawn in two pieces
    through one scratch buffer of half of them, each piece compared into its
    part of the mask: the draw then holds 3 bytes per element (the mask's 1,
    half the words' 4) where one draw held 5, less than the 4-byte noise
    ``nn.Dropout`` allocates. This matters in a recompute that early stop ends
    at the dropout (NOTE [ two formulations ]): there the draw is all the
    dropout allocates. On CPU the second piece continues the first one's
    sequential stream, so the bits are those of one draw (tested); on CUDA
    each ``random_`` starts at a new Philox offset, so the bits depend on the
    split, which depends on the shape alone. The second piece costs a
    ``random_`` and a compare more.
    """
    keep = min(round((1.0 - p) * 2.0**32), (1 << 32) - 1)
    return keep - (1 << 31)


@functools.lru_cache(maxsize=_CACHE_SIZE)  # computing it costs a kernel and a sync
def _scale(p: float, dtype: torch.dtype) -> float:
    return float(torch.ones((), dtype=dtype, device="cpu").div_(1.0 - p))


@dataclass(frozen=True)
class Mask:
    """Everything needed to rebuild one call's mask and its scaling."""

    seed: int
    p: float
    shape: tuple[int, ...]
    device: torch.device
    alpha: bool
    save_mask: bool

    def keep(self) -> Tensor:
        """The keep-mask as 0/1 bytes (``uint8``): one definition for every
        formulation (NOTE [ two formulations ]).

        The compare's ``bool`` viewed as ``uint8`` (free): converting ``uint8``
        to float took 5 us for 32k elements on CPU, ``bool`` 21 us. Large masks
        draw their bits in pieces (NOTE [ mask bits ]), or on CPU hash them in
        chunks (NOTE [ hashed bits ]). Its ops run aside (``core/_own_ops.py``): both runs
        of a region draw the same bits, which selective saving neither numbers nor keeps.
        """
        with aside():
            return self._keep()

    def _keep(self) -> Tensor:
        numel = math.prod(self.shape)
        threshold = _threshold(self.p)
        if numel >= HASHED_FROM_ELEMENTS and self.device.type in HASHED_DEVICES:
            keep = torch.empty((numel,), dtype=torch.bool, device=self.device)
            _hashed_keep(self.seed, threshold, keep)
            return keep.view(torch.uint8).view(self.shape)
        generator = _mask_generator(self.device)
        generator.manual_seed(self.seed)
        words = (numel + 1) // 2
        half = words if numel < PIECES_FROM_ELEMENTS else (words + 1) // 2
        with scoped_draws():
            scratch = torch.empty((half,), dtype=torch.int64, device=self.device)
            _random_words(scratch, generator)
            bits = scratch.view(torch.int32)
            if half == words:
                keep = (bits if bits.numel() == numel else bits[:numel]).lt(threshold)
            else:  # two pieces through one scratch buffer
                keep = torch.empty((numel,), dtype=torch.bool, device=self.device)
                torch.lt(bits, threshold, out=keep[: 2 * half])
                rest = numel - 2 * half
                tail = scratch[: (rest + 1) // 2]
                _random_words(tail, generator)
                torch.lt(tail.view(torch.int32)[:rest], threshold, out=keep[2 * half :])
        return keep.view(torch.uint8).view(self.shape)

    def draw(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The keep-mask as 0/1 in ``dtype``, and as bytes to keep for backward
        (``save_mask``) or None."""
        keep = self.keep()
        return keep.to(dtype), (keep if self.save_mask else None)

    def unit(self, kept: Tensor | None, dtype: torch.dtype) -> Tensor:
        """The 0/1 mask in ``dtype`` for backward: from the kept bytes, or drawn again."""
        return (self.keep() if kept is None else kept).to(dtype)

    def scale(self, dtype: torch.dtype) -> float:
        """What kept elements are multiplied by: ``1 / (1 - p)`` as ATen computes it in ``dtype``.

        The one value both formulations scale by (:meth:`_noise` and ``x * keep
        * scale``), so that they are the same bits in every dtype.
        """
        return _scale(self.p, dtype)

    def _alpha_scale(self) -> float:
        """What alpha dropout multiplies kept elements by: ATen's ``a``."""
        return 1.0 / math.sqrt((_ALPHA * _ALPHA * self.p + 1) * (1 - self.p))

    def _noise(self, unit: Tensor) -> Tensor:
        """The mask scaled, in place, to ATen's own noise values (``_dropout_impl``).

        A kept element's noise is ``1 / (1 - p)`` as the CPU divides it in the
        tensor's dtype (:meth:`scale`; ``1.0f / float(1 - p)`` for float32),
        not a rounded ``1 / (1 - p)`` (the two differ by an ulp for about a
        quarter of all p), and not ``div_`` on the mask's device: CUDA divides
        by a scalar as a multiply by its reciprocal, an ulp off torch's for
        p = 0.021 (measured on an H200, torch 2.11).
        """
        return unit.mul_(self._alpha_scale() if self.alpha else self.scale(unit.dtype))

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
    """``x * noise (+ shift)`` keeping the mask's bytes (``uint8``) or only the seed for backward."""

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


def masked_dropout(input: Tensor, mask: Mask, inplace: bool, recompute: bool = False) -> Tensor:
    """``input`` times ``mask``'s noise, keeping what ``mask.save_mask`` says for backward.

    NOTE [ two formulations ]
    =========================
    The same bits come out of two formulations, and both keep the same tensor
    for backward, so a recompute may take the other one.

    * Plain ATen ops under torch's autograd, when the mask is kept: channel-wise
      ``x * noise`` (autograd keeps the float noise, one value per channel), or
      element-wise ``x * keep * scale`` with a ``uint8`` ``keep`` (autograd keeps
      those bytes, and ``scale`` as a Python number). No ``autograd.Function``:
      its apply and its Python backward cost ~30 us a call, more than the
      kernels of a 64 x 64 dropout.
    * :class:`MaskedDropout` otherwise: alpha dropout, ``save_mask=False``
      (nothing kept, redrawn in backward) and element-wise masks from
      ``NATIVE_BELOW_ELEMENTS`` on, where its backward's in-place float ops
      beat autograd's two out-of-place multiplies (forward + backward at
      256 x 512 on CPU: 626 us against 766).
    * A recompute takes the ATen ops at every size when the mask is kept
      element-wise. Its graph is never differentiated (torch's checkpoint only
      takes the tensors it saves), so the Function's faster backward buys
      nothing there, and its forward is the slower one (477 us against 424 at
      256 x 512). Both keep one tensor, the ``uint8`` ``keep`` of the mask's
      shape, at the same point of the region's sequence of saved tensors,
      which is how torch's checkpoint matches recomputed tensors to the first
      forward's (and what its determinism check compares). And ``mul`` keeps
      ``keep`` before it allocates its output: when the dropout is the last
      op of the region that saves a tensor, early stop ends the recompute
      there, with no output allocated, as it does for ``nn.Dropout``'s noise.

    ``x * keep * scale`` equals ``x * noise`` bit for bit: ``x * 1`` is ``x``,
    ``x * 0`` is the same signed zero (or NaN) as ``x * 0.0``, and ``scale`` is
    the noise's own value in the input's dtype (:meth:`Mask.scale`); the same
    holds for the gradients. tests/test_layers.py checks both against each other
    (on CPU; tests/gpu/check_cuda.py on CUDA, where float16 and bfloat16 kept
    values are an ulp off torch's fused dropout, which scales them in float).
    """
    if not mask.save_mask or mask.alpha:
        return MaskedDropout.apply(input, mask, inplace)
    if mask.shape != tuple(input.shape):  # channel-wise: the noise broadcasts
        return mask.apply(input, mask.unit(None, input.dtype), inplace)
    if input.numel() >= NATIVE_BELOW_ELEMENTS and not recompute:
        return MaskedDropout.apply(input, mask, inplace)
    keep = mask.keep()
    out = input.mul_(keep) if inplace else input * keep
    return out.mul_(mask.scale(input.dtype))
