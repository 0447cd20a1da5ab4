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

import warnings as _warnings

with _warnings.catch_warnings():
    # torch warns at import when NumPy is missing ("Failed to initialize NumPy",
    # torch/csrc/utils/tensor_numpy.cpp). scopedckpt never uses NumPy, so a fresh
    # environment without it must stay quiet; only this message, only here.
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch as _torch  # noqa: F401

# _torch_private refuses a torch older than the oldest tested, whichever import reaches it first.
from . import functional, integrations, policies
from .core._checkpoint import checkpoint, checkpoint_sequential
from .core._errors import ScopedCkptError
from .core._replay import is_recomputing, phase, replay
from .core._sampling import set_verification_sampling
from .core._scope import checkpointing
from .core._state import Phase
from .layers._convert import ConvertWarning, convert
from .layers._layers import (
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
from .mechanisms._module_state import Stateful
from .mechanisms._report import MemoryReport, memory_report
from .planner._measure import measure_peak
from .planner._peak import PeakReport, peak_report
from .planner._plan import Plan, plan

__version__ = "0.1.0"

__all__ = [
    "AlphaDropout",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "ConvertWarning",
    "Dropout",
    "Dropout1d",
    "Dropout2d",
    "Dropout3d",
    "FeatureAlphaDropout",
    "MemoryReport",
    "PeakReport",
    "Phase",
    "Plan",
    "ScopedCkptError",
    "Stateful",
    "checkpoint",
    "checkpoint_sequential",
    "checkpointing",
    "convert",
    "functional",
    "integrations",
    "is_recomputing",
    "measure_peak",
    "memory_report",
    "peak_report",
    "phase",
    "plan",
    "policies",
    "replay",
    "set_verification_sampling",
]
