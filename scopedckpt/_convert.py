"""``convert``: swap torch dropout and batch-norm layers for scoped ones in place."""

from __future__ import annotations

import copy
import warnings

from torch import nn

from . import _layers

__all__ = ["convert"]

# Exact torch types only: a user's subclass may override forward, and
# replacing it would silently drop that code (it is reported instead).
_SCOPED: dict[type[nn.Module], type[nn.Module]] = {
    nn.Dropout: _layers.Dropout,
    nn.Dropout1d: _layers.Dropout1d,
    nn.Dropout2d: _layers.Dropout2d,
    nn.Dropout3d: _layers.Dropout3d,
    nn.AlphaDropout: _layers.AlphaDropout,
    nn.FeatureAlphaDropout: _layers.FeatureAlphaDropout,
    nn.BatchNorm1d: _layers.BatchNorm1d,
    nn.BatchNorm2d: _layers.BatchNorm2d,
    nn.BatchNorm3d: _layers.BatchNorm3d,
}
_SCOPED_TYPES = tuple(set(_SCOPED.values()))
_TORCH_TYPES = tuple(_SCOPED)


def _scoped_copy(module: nn.Module, scoped: type[nn.Module]) -> nn.Module:
    """The same module as an instance of ``scoped``: same tensors, hooks, mode."""
    new = scoped.__new__(scoped)
    # Shallow copies of the registries: same Parameter and buffer objects, and
    # the old module stays a valid module of its own.
    new.__dict__.update(
        {k: (copy.copy(v) if isinstance(v, dict) else v) for k, v in module.__dict__.items()}
    )
    if isinstance(new, _layers._ScopedDropout):
        new.generator = None
        new.save_mask = True
    return new


def convert(module: nn.Module, *, inplace: bool = True) -> nn.Module:
    """Replace torch dropout and batch-norm layers with their scoped subclasses.

    Walks ``module`` like :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`
    and replaces every ``nn.Dropout``, ``nn.Dropout1d/2d/3d``,
    ``nn.AlphaDropout``, ``nn.FeatureAlphaDropout`` and ``nn.BatchNorm1d/2d/3d``
    (exact types) with the scoped class of the same name. Parameters stay the
    same tensor objects; buffers, hooks, training mode, device and dtype are
    kept, so the converted model loads the original's ``state_dict`` with
    ``strict=True`` and gives bit-identical outputs in eval mode. Scoped layers
    are left alone. Subclasses of those torch layers written by users are not
    replaced (their ``forward`` may differ) and a warning names them; so is
    ``nn.MultiheadAttention`` with ``dropout > 0``, whose attention dropout is
    functional inside torch and cannot be replayed.

    Parameters
    ----------
    module
        The model (or a single layer) to convert.
    inplace
        Convert ``module`` itself (default) or a deep copy of it.

    Returns
    -------
    nn.Module
        The converted model; a new object only when ``module`` itself is a
        layer that was replaced or ``inplace=False``.

    Raises
    ------
    TypeError
        If ``module`` is not an ``nn.Module``.

    Example
    -------
    >>> import torch, scopedckpt
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    >>> model = scopedckpt.convert(model)
    >>> type(model[1]).__module__, type(model[1]).__name__
    ('scopedckpt._layers', 'Dropout')
    >>> isinstance(model[1], torch.nn.Dropout)
    True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"scopedckpt: convert expected an nn.Module, got {type(module).__name__}. "
            "Pass the model: scopedckpt.convert(model)."
        )
    if not inplace:
        module = copy.deepcopy(module)
    skipped: list[str] = []
    attention: list[str] = []
    converted = _convert(module, "", skipped, attention)
    if skipped:
        warnings.warn(
            "scopedckpt: convert left these subclasses of torch dropout/batch-norm layers "
            f"unchanged, since their forward may differ from torch's: {', '.join(skipped)}. "
            "Make them subclass the scoped layers (e.g. scopedckpt.Dropout) to replay them "
            "exactly in checkpoint recomputes.",
            stacklevel=2,
        )
    if attention:
        warnings.warn(
            "scopedckpt: nn.MultiheadAttention applies its attention dropout functionally "
            f"inside torch, which cannot be replayed: {', '.join(attention)}. Set their "
            "dropout to 0.0 (e.g. layer.self_attn.dropout = 0.0) or keep them outside "
            "checkpoint regions to keep training exact.",
            stacklevel=2,
        )
    return converted


def _convert(module: nn.Module, name: str, skipped: list[str], attention: list[str]) -> nn.Module:
    label = name or "<root>"
    result = module
    if isinstance(module, _SCOPED_TYPES):
        pass
    elif type(module) in _SCOPED:
        result = _scoped_copy(module, _SCOPED[type(module)])
    elif isinstance(module, _TORCH_TYPES):
        skipped.append(f"{label} ({type(module).__qualname__})")
    elif isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
        attention.append(f"{label} (dropout={module.dropout})")
    for child_name, child in list(result.named_children()):
        new_child = _convert(
            child, f"{name}.{child_name}" if name else child_name, skipped, attention
        )
        if new_child is not child:
            setattr(result, child_name, new_child)
    return result
