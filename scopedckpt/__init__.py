"""Exact activation checkpointing for PyTorch models with dropout and batch norm.

Wrap a forward in :func:`checkpointing` and mark regions with
:func:`checkpoint` (or name modules as targets); scoped layers replay their
first forward in the backward recompute, so training with checkpointing is
bit-for-bit training without it.

Example
-------
>>> import torch, scopedckpt
>>> model = scopedckpt.convert(torch.nn.Sequential(
...     torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.2)))
>>> with scopedckpt.checkpointing(model):
...     loss = model(torch.randn(4, 8)).sum()
>>> loss.backward()
"""

from . import functional
from ._convert import convert
from ._engine import checkpoint
from ._errors import ScopedCkptError
from ._layers import (
    AlphaDropout,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Dropout,
    Dropout1d,
    Dropout2d,
    Dropout3d,
    FeatureAlphaDropout,
)
from ._scope import checkpointing
from ._state import Phase, is_recomputing, phase

__version__ = "0.1.0"

__all__ = [
    "AlphaDropout",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Dropout",
    "Dropout1d",
    "Dropout2d",
    "Dropout3d",
    "FeatureAlphaDropout",
    "Phase",
    "ScopedCkptError",
    "checkpoint",
    "checkpointing",
    "convert",
    "functional",
    "is_recomputing",
    "phase",
]
