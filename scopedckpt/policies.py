"""Preset ``save=`` policies for selective saving.

Each preset is a tuple of aten op packets (every overload of the op), so
presets combine with each other and with module items by ``+``::

    with scopedckpt.checkpointing(model.layers, save=policies.save_matmuls + ("norm*",)):
        ...

What a preset keeps is the output of every call of its ops inside a region
(not inside a nested region); every other op is recomputed in backward. The op
names are what a dispatch mode sees below autograd, after torch's composite
ops (``linear``, ``matmul``, ``conv2d``, ``scaled_dot_product_attention``)
have been decomposed: an ``nn.Linear`` is ``addmm`` (2-D input, or N-D input
torch folds to 2-D) or ``mm``; batched ``matmul`` is ``bmm``; every
convolution is ``convolution``; fused attention is one of the
``_scaled_dot_product_*`` kernels. Attention that falls back to torch's math
path (or is written out, as in Hugging Face's "eager" attention) is matmuls
and a softmax: ``save_matmuls`` keeps its matmuls.

Example
-------
>>> import torch, scopedckpt
>>> from scopedckpt import policies
>>> layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
>>> x = torch.randn(2, 5, 16, requires_grad=True)
>>> with scopedckpt.checkpointing(layer, save=policies.save_matmuls):
...     y = layer(x)
>>> y.sum().backward()   # recomputes all but the matmuls' outputs
"""

from __future__ import annotations

import torch

from .core._torch_private import OpOverload, OpOverloadPacket
from .mechanisms._selective import why_not_keepable

__all__ = ["keepable", "save_attention", "save_compute", "save_convolutions", "save_matmuls"]

_aten = torch.ops.aten

save_matmuls: tuple[OpOverloadPacket, ...] = (
    _aten.mm,
    _aten.addmm,
    _aten.bmm,
    _aten.baddbmm,
    _aten._addmm_activation,
)
"""Matrix products: ``nn.Linear``, ``matmul``/``@``, batched attention scores."""

save_attention: tuple[OpOverloadPacket, ...] = tuple(
    getattr(_aten, name)
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(_aten, name)
)
"""The fused kernels behind ``F.scaled_dot_product_attention`` (dropout replayed exactly)."""

save_convolutions: tuple[OpOverloadPacket, ...] = (_aten.convolution,)
"""Every ``nn.Conv*`` and ``F.conv*``."""

save_compute: tuple[OpOverloadPacket, ...] = save_matmuls + save_attention + save_convolutions
"""The expensive ops of most models: matmuls, fused attention and convolutions;
the cheap elementwise ops, normalisations and dropout between them are recomputed."""


def keepable(op: OpOverload) -> bool:
    """Whether selective saving can keep this op's output.

    Not keepable: ops that change an argument in place (``relu_``, ``add_``,
    ``out=`` forms), ops that return a view of an argument (``t``, ``view``),
    and tensor factories (``zeros``, ``rand``, ``empty_like``...); see
    docs/selective.md. A callable policy that selects an op it cannot keep
    raises, so callables that select broadly ask this first.

    Example
    -------
    >>> import torch
    >>> from scopedckpt import policies
    >>> policies.keepable(torch.ops.aten.mm.default), policies.keepable(torch.ops.aten.relu_.default)
    (True, False)
    >>> def save_everything(ctx, op, *args, **kwargs):
    ...     return policies.keepable(op)
    """
    return why_not_keepable(op) is None
