"""Scoped dropout alone against ``nn.Dropout``: bytes kept, time by size, and what sets its floor.

* :func:`bytes_per_element` and :func:`step_ratio`: the tables of ``run.py``'s
  results (``dropout_bytes_per_element``, ``dropout_time_ratio``).
* :func:`floor`: a 64 x 64 dropout's forward + backward against ``nn.Dropout``: the
  scoped layer, the plain ATen formulations it is built from (with no scopedckpt
  bookkeeping at all), and the kernels that draw the mask.
* :func:`formulations`: the scoped layer's two formulations (NOTE [ two formulations ]
  in ``scopedckpt/layers/_mask.py``) against ``nn.Dropout`` by size: what
  ``NATIVE_BELOW_ELEMENTS`` was chosen from.

The last two are sections of ``breakdown.main``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import scopedckpt

from .internals import ForcedFormulation, dropout_mask, random_words, saved_activation_bytes
from .timing import interleaved


def bytes_per_element() -> dict[str, float]:
    """Bytes a lone dropout keeps for backward, per input element."""
    x = torch.randn(1 << 20, requires_grad=True)
    n = x.numel()
    result = {}
    for name, layer in (
        ("nn.Dropout", nn.Dropout(0.1)),
        ("scopedckpt.Dropout(save_mask=True)", scopedckpt.Dropout(0.1)),
        ("scopedckpt.Dropout(save_mask=False)", scopedckpt.Dropout(0.1, save_mask=False)),
    ):
        result[name] = saved_activation_bytes(lambda layer=layer: layer(x)) / n
    return result


def step_ratio(repeats: int) -> dict[str, dict[str, float]]:
    """Forward+backward time of the two scoped mask options relative to nn.Dropout, by size."""
    result = {}
    for rows, cols in ((64, 64), (256, 256), (1024, 1024)):
        x = torch.randn(rows, cols, requires_grad=True)
        layers = {
            "nn": nn.Dropout(0.1),
            "save": scopedckpt.Dropout(0.1),
            "regen": scopedckpt.Dropout(0.1, save_mask=False),
        }
        calls = max(1, (1 << 16) // (rows * cols)) * 4  # per sample: enough to time
        median = interleaved(
            {k: (lambda m=m, x=x: m(x).sum().backward()) for k, m in layers.items()},
            calls=calls,
            rounds=repeats,
        )
        base = median["nn"]
        result[f"{rows}x{cols}"] = {k: seconds / base for k, seconds in median.items()}
    return result


def floor(rounds: int) -> dict[str, float]:
    """A 64 x 64 dropout, forward + backward, relative to ``nn.Dropout``."""
    p = 0.1
    x = torch.randn(64, 64, requires_grad=True)
    mask = dropout_mask(x, p)
    scale = mask.scale(x.dtype)

    def one_byte() -> torch.Tensor:
        # What the scoped layer runs below NATIVE_BELOW_ELEMENTS, with none of its
        # bookkeeping: two autograd nodes, 1 byte per element kept.
        return (x * mask.keep()).mul_(scale)

    def four_bytes() -> torch.Tensor:
        # One autograd node, as nn.Dropout: keeps the float noise, 4 bytes per element.
        return x * mask.keep().to(x.dtype).mul_(scale)

    generator = torch.Generator()

    def bits() -> torch.Tensor:
        generator.manual_seed(1)
        words = torch.empty((x.numel() // 2,), dtype=torch.int64)
        return random_words(words, generator)

    reference = nn.Dropout(p)
    layers = {
        "scopedckpt.Dropout(save_mask=True)": scopedckpt.Dropout(p),
        "scopedckpt.Dropout(save_mask=False)": scopedckpt.Dropout(p, save_mask=False),
    }
    variants: dict[str, Callable[[], object]] = {
        "nn.Dropout": lambda: reference(x).sum().backward(),
        **{name: (lambda m=m: m(x).sum().backward()) for name, m in layers.items()},
        "ATen ops, 1 byte kept (two nodes)": lambda: one_byte().sum().backward(),
        "ATen ops, 4 bytes kept (one node)": lambda: four_bytes().sum().backward(),
        "sum + backward alone": lambda: x.sum().backward(),
    }
    median = interleaved(variants, calls=500, rounds=rounds)
    kernels = interleaved(
        {
            "reseed + the mask's bits": bits,
            "reseed + the mask's bits + compare": mask.keep,
            "bernoulli_": lambda: torch.empty_like(x).bernoulli_(1 - p),
        },
        calls=500,
        rounds=rounds,
    )
    base = median["nn.Dropout"]
    result = {name: seconds / base for name, seconds in median.items()}
    result.update({f"{name}, us": seconds * 1e6 for name, seconds in kernels.items()})
    result["nn.Dropout, us"] = base * 1e6
    return result


def formulations(rounds: int) -> dict[str, dict[str, float]]:
    """Forward + backward of ``scopedckpt.Dropout(0.1)`` in each formulation, by size,
    relative to ``nn.Dropout(0.1)``."""
    reference, layer = nn.Dropout(0.1), scopedckpt.Dropout(0.1)

    def forced(x: torch.Tensor, native: bool) -> None:
        with ForcedFormulation(x, native):
            layer(x).sum().backward()

    result = {}
    for rows, cols in ((64, 64), (128, 128), (128, 256), (256, 256), (256, 512), (512, 512)):
        x = torch.randn(rows, cols, requires_grad=True)
        median = interleaved(
            {
                "nn.Dropout": lambda x=x: reference(x).sum().backward(),
                "ATen ops": lambda x=x: forced(x, native=True),
                "autograd.Function": lambda x=x: forced(x, native=False),
            },
            calls=max(10, (1 << 18) // x.numel()),
            rounds=rounds,
        )
        base = median.pop("nn.Dropout")
        result[f"{rows}x{cols}"] = {name: seconds / base for name, seconds in median.items()}
    return result
