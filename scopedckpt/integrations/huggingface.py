"""Hugging Face transformers: route ``gradient_checkpointing`` through scopedckpt.

Hugging Face models checkpoint each layer (``GradientCheckpointingLayer``) by
calling a stored function, ``torch.utils.checkpoint.checkpoint`` by default,
after turning the layer's cache off (``use_cache=False``, ``cache=None``) as
their own checkpointing requires. :func:`gradient_checkpointing_enable` keeps
all of that and stores a scopedckpt region instead, so dropout in attention,
``dropout_p`` of SDPA and every buffer are replayed exactly. transformers is
not imported here: the model brings its own methods.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from .._engine import REENTRANT_MESSAGE, layer_of, region_outside_dynamo
from .._errors import ScopedCkptError
from .._state import DEFAULT_SCOPE, SCOPE

__all__ = ["gradient_checkpointing_enable"]


def _checkpoint(function: Callable[..., Any], *args: Any, **torch_kwargs: Any) -> Any:
    """What Hugging Face layers call instead of ``torch.utils.checkpoint.checkpoint``."""
    if torch_kwargs.get("use_reentrant"):
        raise ScopedCkptError(
            f"{REENTRANT_MESSAGE} (Hugging Face asked for it: enable checkpointing with "
            "scopedckpt.integrations.huggingface.gradient_checkpointing_enable(model) and no "
            "gradient_checkpointing_kwargs.)"
        )
    layer = layer_of(function)
    scope = SCOPE.get() or DEFAULT_SCOPE
    # Called from model code, which may be compiled: the eager region, behind a graph break.
    return region_outside_dynamo(function, layer, args, {}, scope=scope)


def gradient_checkpointing_enable(model: nn.Module, *, every_n_layers: int = 1) -> nn.Module:
    """Turn on a Hugging Face model's gradient checkpointing, made exact by scopedckpt.

    Calls the model's own ``activation_checkpointing_enable`` (or, in
    transformers 4.x, ``gradient_checkpointing_enable``) so that everything it
    does still happens (``use_cache`` turned off in training, input gradients),
    then stores a scopedckpt region as every layer's checkpoint function. Each
    layer's forward then runs as a region whenever Hugging Face checkpoints it
    (training mode, grad enabled), with or without a surrounding
    :func:`scopedckpt.checkpointing` block; inside one, its ``strict`` and
    ``enabled`` settings apply. Turn it off with the model's own
    ``gradient_checkpointing_disable()``.

    Do not also select the same layers as :func:`scopedckpt.checkpointing`
    targets: each layer would be a region inside a region (still exact, but
    recomputed twice).

    Parameters
    ----------
    model
        A ``transformers.PreTrainedModel`` that supports gradient checkpointing.
    every_n_layers
        Checkpoint only every n-th layer, where the installed transformers
        supports it (5.x); must be 1 otherwise.

    Returns
    -------
    nn.Module
        ``model``, for chaining.

    Raises
    ------
    TypeError
        If ``model`` has no Hugging Face gradient checkpointing.
    ValueError
        If ``every_n_layers`` is not 1 and transformers does not support it.

    Example
    -------
    ::

        from transformers import GPT2Config, GPT2LMHeadModel
        from scopedckpt.integrations import huggingface

        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2))
        huggingface.gradient_checkpointing_enable(model)
        model.train()
        loss = model(input_ids, labels=input_ids).loss   # use_cache is turned off
        loss.backward()                                   # exact recomputes
    """
    setter = getattr(model, "_set_gradient_checkpointing", None)
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None
    )
    if setter is None or enable is None:
        raise TypeError(
            f"scopedckpt: gradient_checkpointing_enable expected a Hugging Face "
            f"PreTrainedModel with gradient checkpointing, got {type(model).__name__}. "
            "For other models select the layers: with scopedckpt.checkpointing(model.layers): ..."
        )
    parameters = inspect.signature(setter).parameters
    if "gradient_checkpointing_func" not in parameters:
        raise TypeError(
            "scopedckpt: this model uses the pre-4.35 gradient checkpointing format of "
            "transformers, which does not take a checkpoint function. Upgrade transformers, or "
            "select the layers: with scopedckpt.checkpointing(model.layers): ..."
        )
    options: dict[str, Any] = {}
    if every_n_layers != 1:
        if "every_n_layers" not in parameters:
            raise ValueError(
                "scopedckpt: every_n_layers needs transformers 5 or newer; pass every_n_layers=1."
            )
        options["every_n_layers"] = every_n_layers
    enable(**options)
    setter(enable=True, gradient_checkpointing_func=_checkpoint, **options)
    return model
