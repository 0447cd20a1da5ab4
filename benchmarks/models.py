"""The benchmark models and their training steps, shared by every section.

Every model is a :class:`Blocks`: a stem, a stack of blocks (one region each) and a
head, built from ``torch.manual_seed(0)`` with its input. The configurations of the
step-time table (``CONFIGS``) differ only in the layers (torch's or converted) and in
how each block is run (:attr:`Blocks.mode`):

  (a) plain torch layers, no checkpointing
  (b) torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True)
  (c) scopedckpt regions (``scopedckpt.checkpoint``) with scoped layers
  (d) scoped layers, no checkpointing
  (e) (c) with preserve_rng_state=False (no RNG stash)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.utils.checkpoint as tc
from torch import nn

import scopedckpt

from .internals import saved_activation_bytes

CONFIGS = ("a", "b", "c", "d", "e")
NAMES = {
    "a": "plain nn",
    "b": "torch.utils.checkpoint",
    "c": "scopedckpt",
    "d": "scoped layers, no ckpt",
    "e": "scopedckpt, no RNG stash",
}
CONVERTED = frozenset({"c", "d", "e"})
CHECKPOINTED_BY_SCOPEDCKPT = frozenset({"c", "e"})


class Blocks(nn.Module):
    """A stem, a stack of blocks (the regions) and a head.

    ``mode`` is the configuration letter: ``"b"`` wraps each block in torch's
    checkpoint, ``"c"`` and ``"e"`` in ``scopedckpt.checkpoint``, anything else calls
    the blocks directly (regions may still come from a scope's targets).
    """

    def __init__(self, blocks: list[nn.Module], stem: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = stem, nn.ModuleList(blocks), head
        self.mode = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            if self.mode == "b":
                x = tc.checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)
            elif self.mode == "c":
                x = scopedckpt.checkpoint(block, x)
            elif self.mode == "e":
                x = scopedckpt.checkpoint(block, x, preserve_rng_state=False)
            else:
                x = block(x)
        return self.head(x)


class ResBlock(nn.Module):
    """Conv-BN-ReLU-Dropout2d-Conv-BN with a residual and a ReLU after it."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Dropout2d(0.1),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.body(x)).relu()


def mlp(depth: int) -> tuple[Blocks, torch.Tensor]:
    """Linear(512)-BatchNorm1d-GELU-Dropout blocks, batch 256."""
    w = 512
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(w, w), nn.BatchNorm1d(w), nn.GELU(), nn.Dropout(0.1))
        for _ in range(depth)
    ]
    return Blocks(blocks, nn.Identity(), nn.Linear(w, 10)), torch.randn(256, w)


def transformer(depth: int) -> tuple[Blocks, torch.Tensor]:
    """``nn.TransformerEncoderLayer`` blocks, d=128, 4 heads, batch 16 x 64 tokens."""
    d = 128
    blocks: list[nn.Module] = []
    for _ in range(depth):
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        layer.self_attn.dropout = 0.0  # functional inside torch: not replayable
        blocks.append(layer)
    return Blocks(blocks, nn.Identity(), nn.Linear(d, 10)), torch.randn(16, 64, d)


def _convnet(c: int, depth: int, batch: int, size: int) -> tuple[Blocks, torch.Tensor]:
    stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
    blocks: list[nn.Module] = [ResBlock(c) for _ in range(depth)]
    return Blocks(blocks, stem, head), torch.randn(batch, 3, size, size)


def cnn(depth: int) -> tuple[Blocks, torch.Tensor]:
    """:class:`ResBlock` blocks, 32 channels, batch 16 of 32 x 32 images."""
    return _convnet(32, depth, batch=16, size=32)


def small_cnn(depth: int) -> tuple[Blocks, torch.Tensor]:
    """Small ops: :class:`ResBlock` blocks, 16 channels, batch 8 of 16 x 16 images."""
    return _convnet(16, depth, batch=8, size=16)


def small_mlp(depth: int) -> tuple[Blocks, torch.Tensor]:
    """Small ops, where per-region Python shows: Linear(256)-BN-GELU-Dropout-Linear, batch 128."""
    w = 256
    blocks: list[nn.Module] = [
        nn.Sequential(
            nn.Linear(w, w), nn.BatchNorm1d(w), nn.GELU(), nn.Dropout(0.1), nn.Linear(w, w)
        )
        for _ in range(depth)
    ]
    return Blocks(blocks, nn.Identity(), nn.Linear(w, 10)), torch.randn(128, w)


def wide_mlp(depth: int) -> tuple[Blocks, torch.Tensor]:
    """Large matmuls, few ops (selective saving only): Linear(1024, 2048)-GELU-Dropout-
    Linear(2048, 1024), batch 256."""
    w = 1024
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(w, 2 * w), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * w, w))
        for _ in range(depth)
    ]
    return Blocks(blocks, nn.Identity(), nn.Linear(w, 10)), torch.randn(256, w)


Builder = Callable[[int], tuple[Blocks, torch.Tensor]]

# The step-time table's models, in its order.
MODELS: dict[str, Builder] = {
    "small_mlp": small_mlp,
    "mlp": mlp,
    "transformer": transformer,
    "cnn": cnn,
}


def build(kind: str, depth: int, config: str) -> tuple[Blocks, torch.Tensor]:
    """Model ``kind`` (a key of ``MODELS``, or ``"small_cnn"``) at ``depth`` blocks,
    converted for (c), (d) and (e), in ``config``'s mode; from seed 0."""
    torch.manual_seed(0)
    model, x = {**MODELS, "small_cnn": small_cnn}[kind](depth)
    if config in CONVERTED:
        model = cast(Blocks, scopedckpt.convert(model))
    model.mode = config
    return model, x


def clear_grads(model: nn.Module) -> None:
    """Every parameter's gradient to None, as ``zero_grad()`` leaves them."""
    for p in model.parameters():
        p.grad = None


def step(model: Blocks, x: torch.Tensor) -> None:
    """One training step in the model's configuration; gradients cleared after it."""
    with scopedckpt.checkpointing(enabled=model.mode in CHECKPOINTED_BY_SCOPEDCKPT):
        loss = model(x).square().mean()
    loss.backward()
    clear_grads(model)


def plain_step(model: Blocks, x: torch.Tensor) -> None:
    """One training step with no scopedckpt code at all (torch's checkpoint in mode b)."""
    model(x).square().mean().backward()
    clear_grads(model)


def region_step(model: Blocks, x: torch.Tensor) -> None:
    """One training step with every block a region through the scope's targets:
    ``with scopedckpt.checkpointing(model.blocks):`` around the forward."""
    with scopedckpt.checkpointing(model.blocks):
        loss = model(x).square().mean()
    loss.backward()
    clear_grads(model)


def saved_bytes(model: Blocks, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward after the forward (parameters excluded)."""

    def forward() -> torch.Tensor:
        with scopedckpt.checkpointing(enabled=model.mode in CHECKPOINTED_BY_SCOPEDCKPT):
            return model(x)

    return saved_activation_bytes(forward, exclude=model.parameters())


def dropouts(model: nn.Module) -> int:
    """How many dropout layers (torch's or scoped) the model has."""
    return sum(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())
