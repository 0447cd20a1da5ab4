"""torchvision's stochastic depth and its ConvNeXt and MBConv blocks, replicated verbatim.

For torch releases without a torchvision that imports: the real-model families train
these where torchvision's own models cannot be built (``real_families.torchvision_replica``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def stochastic_depth(x: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """torchvision.ops.stochastic_depth (torchvision/ops/stochastic_depth.py, 0.28)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ["batch", "row"]:
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return x
    survival_rate = 1.0 - p
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return x * noise


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        return stochastic_depth(x, self.p, self.mode, self.training)


class _Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: Tensor) -> Tensor:
        return x.permute(*self.dims)


class CNBlock(nn.Module):
    """torchvision.models.convnext.CNBlock."""

    def __init__(self, dim: int, layer_scale: float, sd_prob: float) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim),
            _Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Linear(4 * dim, dim),
            _Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, x: Tensor) -> Tensor:
        result = self.stochastic_depth(self.layer_scale * self.block(x))
        result += x
        return result


class MBConv(nn.Module):
    """torchvision.models.efficientnet.MBConv (expand, depthwise, SE, project)."""

    def __init__(self, dim: int, expand: int, sd_prob: float) -> None:
        super().__init__()
        hidden, squeeze = dim * expand, max(1, dim // 4)
        self.block = nn.Sequential(
            nn.Conv2d(dim, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.SiLU(),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.SiLU(),
        )
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(hidden, squeeze, 1),
            nn.SiLU(),
            nn.Conv2d(squeeze, hidden, 1),
            nn.Sigmoid(),
        )
        self.project = nn.Sequential(nn.Conv2d(hidden, dim, 1, bias=False), nn.BatchNorm2d(dim))
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, x: Tensor) -> Tensor:
        h = self.block(x)
        result = self.stochastic_depth(self.project(h * self.se(h)))
        result += x
        return result
