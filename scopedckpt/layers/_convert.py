"""``convert``: swap torch dropout and batch-norm layers for scoped ones in place."""

from __future__ import annotations

import copy
import warnings

from torch import nn

from ..core._torch_private import DropoutBase, NormBase
from . import _layers

__all__ = ["ConvertWarning", "convert"]


class ConvertWarning(UserWarning):
    """Issued by :func:`scopedckpt.convert` for modules it left unscoped.

    Those modules stay exact inside checkpoint regions through the RNG replay
    and the buffer guard; the warning names them so that a model is never
    converted silently only in part. Filter it by class once you have read it:
    ``warnings.filterwarnings("ignore", category=scopedckpt.ConvertWarning)``.

    Example
    -------
    >>> import scopedckpt
    >>> issubclass(scopedckpt.ConvertWarning, UserWarning)
    True
    """


# Random layers of timm and torchvision, known by class name so that neither
# library is imported: they draw with bernoulli_ from the default generator.
_RANDOM_BY_NAME = {
    "DropPath": "drop path",
    "DropBlock2d": "drop block",
    "DropBlock": "drop block",
    "StochasticDepth": "stochastic depth",
}

# Each torch layer to the scoped layer of its name. Exact torch types only: a user's
# subclass may override forward, and replacing it would silently drop that code (it is
# reported instead).
_SCOPED: dict[type[nn.Module], type[nn.Module]] = {
    getattr(nn, name): getattr(_layers, name) for name in _layers.__all__
}
_SCOPED_TYPES = tuple(set(_SCOPED.values()))
# Fused modules that read their children's buffers outside the children's calls (QAT's
# ConvBn2d folds bn.running_var into its weight before calling bn): a scoped child keeps
# no copies for those reads, so their children stay torch's, under the buffer guard.
_READS_CHILDREN = "torch.ao.nn.intrinsic"
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
    are left alone.

    What it cannot replace it names, in one :class:`ConvertWarning` listing
    every module path: subclasses of those torch layers (their ``forward`` may
    differ, e.g. timm's ``BatchNormAct2d``), other layers with running
    statistics, ``nn.MultiheadAttention`` and Hugging Face / timm attention
    modules with attention dropout, timm's ``DropPath`` and ``DropBlock2d`` and
    torchvision's ``StochasticDepth`` (known by class name; neither library is
    imported). These stay exact inside regions through the RNG replay and the
    buffer guard, only slower than scoped layers.

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

    Warns
    -----
    ConvertWarning
        Naming every module left unscoped that draws random numbers or
        updates buffers, and why.

    Example
    -------
    >>> import torch, scopedckpt
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    >>> model = scopedckpt.convert(model)
    >>> type(model[1]).__module__, type(model[1]).__name__
    ('scopedckpt.layers._layers', 'Dropout')
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
    unscoped: list[str] = []
    converted = _convert(module, "", unscoped)
    if unscoped:
        warnings.warn(
            "scopedckpt: convert left these modules unscoped: "
            f"{'; '.join(unscoped)}. Inside checkpoint regions they stay exact through the "
            "replay of the default generators and the buffer guard (docs/real-models.md), "
            "which cost a little per region and per call; only scoped layers are exact with "
            "preserve_rng_state=False and pass checkpointing(strict=True). Make your own "
            "subclasses subclass the scoped layers (e.g. scopedckpt.BatchNorm2d) to put them "
            "on the fast path.",
            ConvertWarning,
            stacklevel=2,
        )
    return converted


def _unscoped_reason(module: nn.Module) -> str | None:
    """Why ``module`` (not replaced) draws random numbers or changes buffers, if it does."""
    kind = type(module)
    if kind.__name__ in _RANDOM_BY_NAME and not kind.__module__.startswith("torch."):
        return _RANDOM_BY_NAME[kind.__name__]
    if isinstance(module, _TORCH_TYPES):
        return "a subclass of a torch layer; its forward may differ from torch's"
    if isinstance(module, NormBase) and module.track_running_stats:
        return "running statistics"
    if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
        return f"functional attention dropout, p={module.dropout}"
    if "Attention" in kind.__name__:
        # Hugging Face and timm attention: F.dropout / sdpa(dropout_p=...) reading
        # either a float attribute or the p of an nn.Dropout child.
        rates = [
            float(value)
            for name, value in vars(module).items()
            if "drop" in name and isinstance(value, float)
        ]
        rates += [child.p for child in module.children() if isinstance(child, DropoutBase)]
        if any(rate > 0 for rate in rates):
            return f"attention dropout applied functionally, p={max(rates)}"
    return None


def _convert(module: nn.Module, name: str, unscoped: list[str], keep: bool = False) -> nn.Module:
    result = module
    if type(module) in _SCOPED and not keep:
        result = _scoped_copy(module, _SCOPED[type(module)])
    elif not isinstance(module, _SCOPED_TYPES) and (reason := _unscoped_reason(module)) is not None:
        reason = "read by its fused parent" if keep else reason
        unscoped.append(f"{name or '<root>'} ({type(module).__qualname__}: {reason})")
    keep = type(result).__module__.startswith(_READS_CHILDREN)
    for child_name, child in list(result.named_children()):
        qualified = f"{name}.{child_name}" if name else child_name
        new_child = _convert(child, qualified, unscoped, keep)
        if new_child is not child:
            setattr(result, child_name, new_child)
    return result
