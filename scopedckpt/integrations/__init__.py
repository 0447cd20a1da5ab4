"""Routes from other code's checkpointing into scopedckpt regions.

- :func:`patch_torch_checkpoint`: calls of ``torch.utils.checkpoint`` made by
  code you do not own (timm's ``checkpoint_seq``, Hugging Face, scripts)
  become scopedckpt regions inside the block.
- :mod:`scopedckpt.integrations.huggingface`: a Hugging Face model's own
  gradient checkpointing, made exact.

Nothing here imports a third-party library at import time.
"""

from __future__ import annotations

from ..core._mechanisms import register_mechanism
from ..core._patch import patch_torch_checkpoint
from . import _hf_cache

__all__ = ["patch_torch_checkpoint"]

register_mechanism(_hf_cache, first=True)  # before any mechanism keeps state
