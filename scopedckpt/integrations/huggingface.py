"""Hugging Face transformers: route gradient checkpointing through scopedckpt.

Hugging Face models checkpoint each layer (``GradientCheckpointingLayer``) by
calling a stored function, ``torch.utils.checkpoint.checkpoint`` by default,
after turning the layer's cache off (``use_cache=False``, ``cache=None``) as
their own checkpointing requires. :func:`gradient_checkpointing_enable` keeps
all of that and stores a scopedckpt region instead, so dropout in attention,
``dropout_p`` of SDPA and every buffer are replayed exactly. transformers is
not imported here: the model brings its own methods.

NOTE [ Hugging Face re-enables ]
================================
transformers stores every layer's checkpoint function through one method,
``PreTrainedModel._set_gradient_checkpointing(enable, gradient_checkpointing_func,
every_n_layers)``, whoever asks: the model's ``activation_checkpointing_enable``
(which ``Trainer`` calls when training starts with
``TrainingArguments(activation_checkpointing=True)`` or its deprecated alias
``gradient_checkpointing=True``), the deprecated ``gradient_checkpointing_enable``,
``*_disable``, peft's ``prepare_model_for_kbit_training``. Each call stores
``functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)``, which used to
replace scopedckpt's function silently (issue 25: an EMA buffer updated twice).

:func:`gradient_checkpointing_enable` therefore puts a :class:`_Setter` on the
model instance in front of that method, for the model's life. It stores a
scopedckpt region (:func:`_region_call`) instead of what it is given, made from
the given partial's keywords: ``use_reentrant=False`` or unset,
``preserve_rng_state``, ``determinism_check``, ``debug``, ``early_stop``,
``context_fn`` and ``respect_saved_tensors_hooks`` keep torch's meaning;
``use_reentrant=True``, ``offload=True`` (transformers wraps torch's checkpoint
in ``save_on_cpu``) and any other key raise :class:`ScopedCkptError` (a bad
value raises as in :func:`scopedckpt.checkpoint`) before anything is stored, so
``Trainer.train()`` stops at its start. ``every_n_layers``
passes through: the last enable decides which layers. Disabling stores a region
too, with the layers off, so a re-enable, or a layer's flag set by hand, is
scopedckpt's again. The setter is an object holding the model, not a closure,
so that ``copy.deepcopy`` carries it over bound to the copy. The enable methods
are not wrapped instead: a wrapper misses the other callers, and one of the
deprecated ``gradient_checkpointing_enable`` would count as an override, so
transformers would route every ``activation_checkpointing_enable`` through it
and warn.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..core._checkpoint import _DETERMINISM_CHECKS, reentrant_message
from ..core._engine import region_outside_dynamo
from ..core._errors import ScopedCkptError
from ..core._names import layer_of
from ..core._options import DEFAULT_OPTIONS, RegionOptions
from ..core._state import DEFAULT_SCOPE, SCOPE
from ..core._torch_private import PATH

__all__ = ["HONOURED_KWARGS", "gradient_checkpointing_enable"]

#: The checkpoint kwargs (``gradient_checkpointing_kwargs``) a scopedckpt region takes,
#: with torch's meaning; ``use_reentrant`` only as ``False``.
HONOURED_KWARGS = (
    "use_reentrant",
    "preserve_rng_state",
    "determinism_check",
    "debug",
    "early_stop",
    "context_fn",
    "respect_saved_tensors_hooks",
)

_KWARGS_SOURCE = (
    "the activation_checkpointing_kwargs or gradient_checkpointing_kwargs of TrainingArguments, "
    "or the kwargs given to the model's activation_checkpointing_enable or "
    "gradient_checkpointing_enable"
)


def _region_options(
    keywords: Mapping[str, Any], base: RegionOptions = DEFAULT_OPTIONS
) -> RegionOptions:
    """``base`` with torch's checkpoint ``keywords`` (only :data:`HONOURED_KWARGS`) applied."""
    if keywords.get("use_reentrant"):
        raise ScopedCkptError(
            reentrant_message(
                "Hugging Face gradient checkpointing with use_reentrant=True",
                f"It came through {_KWARGS_SOURCE}: pass {{'use_reentrant': False}} there, "
                "or leave the key out. ",
            )
        )
    determinism_check = keywords.get("determinism_check", base.determinism_check)
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"scopedckpt: determinism_check must be one of {_DETERMINISM_CHECKS}, "
            f"but got {determinism_check!r} from {_KWARGS_SOURCE}."
        )
    if keywords.get("respect_saved_tensors_hooks") is not None and not PATH.respects_hooks:
        raise TypeError(
            "scopedckpt: respect_saved_tensors_hooks needs torch >= 2.14 and this torch has no "
            f"such keyword; remove it from {_KWARGS_SOURCE}."
        )
    fields = {name: value for name, value in keywords.items() if name != "use_reentrant"}
    for name in ("preserve_rng_state", "debug", "early_stop"):
        if name in fields:
            fields[name] = bool(fields[name])
    return dataclasses.replace(base, **fields) if fields else base


def _region_call(
    options: RegionOptions, function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """What Hugging Face layers call instead of ``torch.utils.checkpoint.checkpoint``.

    Stored as ``functools.partial(_region_call, options)``. Like torch's, it
    consumes torch's keywords and hands every other keyword to ``function``.
    """
    if kwargs:  # Hugging Face layers pass none; torch's keywords, if any, take effect
        torch_keywords = {name: kwargs.pop(name) for name in HONOURED_KWARGS if name in kwargs}
        options = _region_options(torch_keywords, options)
    layer = layer_of(function)
    scope = SCOPE.get() or DEFAULT_SCOPE
    # Called from model code, which may be compiled: the eager region, behind a graph break.
    return region_outside_dynamo(function, layer, args, kwargs, options, scope=scope)


_DEFAULT_REGION = functools.partial(_region_call, DEFAULT_OPTIONS)


def _is_region(function: object) -> bool:
    return isinstance(function, functools.partial) and function.func is _region_call


def _is_torch_checkpoint(function: object) -> bool:
    """torch's ``checkpoint``, also as ``patch_torch_checkpoint`` or a decorator wraps it."""
    return (
        getattr(function, "__module__", None) == "torch.utils.checkpoint"
        and getattr(function, "__name__", None) == "checkpoint"
    )


def _as_region(function: Callable[..., Any] | None) -> Callable[..., Any]:
    """The scopedckpt region standing for the checkpoint function transformers built."""
    if function is None or _is_torch_checkpoint(function):
        return _DEFAULT_REGION
    if _is_region(function):
        return function
    inner = function.func if isinstance(function, functools.partial) else function
    if isinstance(function, functools.partial) and not function.args:
        if _is_torch_checkpoint(inner):
            unknown = sorted(set(function.keywords) - set(HONOURED_KWARGS))
            if unknown:
                raise ScopedCkptError(
                    f"scopedckpt: Hugging Face gradient checkpointing was enabled with "
                    f"{', '.join(map(repr, unknown))} among its checkpoint kwargs "
                    f"({_KWARGS_SOURCE}), which scopedckpt regions do not take. Remove "
                    f"{'it' if len(unknown) == 1 else 'them'}; scopedckpt takes "
                    f"{', '.join(HONOURED_KWARGS)}, with torch's meaning "
                    "(use_reentrant only as False)."
                )
            return functools.partial(_region_call, _region_options(function.keywords))
    if getattr(inner, "__name__", None) == "checkpoint_func" and "checkpointing_enable" in str(
        getattr(inner, "__qualname__", "")
    ):
        raise ScopedCkptError(
            "scopedckpt: Hugging Face gradient checkpointing was enabled with offload=True "
            "(activation_checkpointing_kwargs={'offload': True} in TrainingArguments, or the "
            "model's activation_checkpointing_enable(offload=True)), for which transformers "
            "wraps torch's checkpoint in torch.autograd.graph.save_on_cpu. scopedckpt's "
            "Hugging Face integration does not offload activations: remove offload."
        )
    raise ScopedCkptError(
        f"scopedckpt: transformers was asked to store {function!r} as the checkpoint "
        "function of a model whose checkpointing goes through scopedckpt "
        "(scopedckpt.integrations.huggingface.gradient_checkpointing_enable), and scopedckpt "
        "cannot make it an exact region. Enable checkpointing with the model's "
        "activation_checkpointing_enable (or Trainer's activation_checkpointing=True) "
        "instead of storing a function yourself."
    )


class _Setter:
    """The model's ``_set_gradient_checkpointing`` once the integration is on.

    NOTE [ Hugging Face re-enables ]: whatever checkpoint function transformers
    stores becomes a scopedckpt region.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def original(self) -> Callable[..., Any]:
        """The model class's own ``_set_gradient_checkpointing``, bound to the model."""
        method: Any = getattr(type(self.model), "_set_gradient_checkpointing")  # noqa: B009
        return method.__get__(self.model)

    def __call__(
        self,
        enable: bool = True,
        gradient_checkpointing_func: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        function = _as_region(gradient_checkpointing_func) if enable else _DEFAULT_REGION
        return self.original(enable=enable, gradient_checkpointing_func=function, **kwargs)

    def __repr__(self) -> str:
        return f"<scopedckpt setter of {type(self.model).__name__}._set_gradient_checkpointing>"


def _owner(model: nn.Module) -> nn.Module | None:
    """The Hugging Face model that owns ``model._set_gradient_checkpointing`` (peft's
    wrappers forward attribute reads to it), or None if it has none."""
    setter = getattr(model, "_set_gradient_checkpointing", None)
    if isinstance(setter, _Setter):
        return setter.model
    owner = getattr(setter, "__self__", None)
    if isinstance(owner, nn.Module) and callable(
        getattr(type(owner), "_set_gradient_checkpointing", None)
    ):
        return owner
    return None


def gradient_checkpointing_enable(model: nn.Module, *, every_n_layers: int = 1) -> nn.Module:
    """Turn on a Hugging Face model's gradient checkpointing, made exact by scopedckpt.

    Calls the model's own ``activation_checkpointing_enable`` (or, in
    transformers 4.x, ``gradient_checkpointing_enable``) so that everything it
    does still happens (``use_cache`` turned off in training, input gradients),
    and stores a scopedckpt region as every layer's checkpoint function. Each
    layer's forward then runs as a region whenever Hugging Face checkpoints it
    (training mode, grad enabled), with or without a surrounding
    :func:`scopedckpt.checkpointing` block; inside one, its ``strict``,
    ``enabled`` and ``save`` settings apply.

    From then on the model keeps scopedckpt's regions when anything enables its
    checkpointing again: ``Trainer`` with ``activation_checkpointing=True`` (or
    ``gradient_checkpointing=True``), the model's own enable methods, a
    re-enable after ``activation_checkpointing_disable()``. Their checkpoint
    kwargs are honoured where they are in :data:`HONOURED_KWARGS`
    (NOTE [ Hugging Face re-enables ]); the last enable's ``every_n_layers``
    decides which layers.

    Do not also select the same layers as :func:`scopedckpt.checkpointing`
    targets: each layer would be a region inside a region (still exact, but
    recomputed twice).

    Parameters
    ----------
    model
        A ``transformers.PreTrainedModel`` that supports gradient checkpointing,
        or a peft model wrapping one.
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
    ScopedCkptError
        Then or later, if checkpointing is enabled with kwargs scopedckpt cannot
        honour (``use_reentrant=True``, ``offload=True``, a key it does not know).

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
    owner = _owner(model)
    activation_enable = getattr(model, "activation_checkpointing_enable", None)
    gradient_enable = getattr(model, "gradient_checkpointing_enable", None)
    if owner is None or (activation_enable is None and gradient_enable is None):
        raise TypeError(
            f"scopedckpt: gradient_checkpointing_enable expected a Hugging Face "
            f"PreTrainedModel with gradient checkpointing, got {type(model).__name__}. "
            "For other models select the layers: with scopedckpt.checkpointing(model.layers): ..."
        )
    setter = _Setter(owner)
    parameters = inspect.signature(setter.original).parameters
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
    if not isinstance(owner.__dict__.get("_set_gradient_checkpointing"), _Setter):
        owner._set_gradient_checkpointing = setter  # type: ignore[assignment]
    if activation_enable is not None:
        activation_enable(**options)
    else:  # transformers 4.x, whose default was use_reentrant=True in some releases
        assert gradient_enable is not None
        gradient_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **options)
    stray = [
        name
        for name, module in owner.named_modules()
        if getattr(module, "gradient_checkpointing", False) is True
        and not _is_region(getattr(module, "_gradient_checkpointing_func", None))
    ]
    if stray:
        raise ScopedCkptError(
            f"scopedckpt: {type(owner).__name__}'s checkpointing switch did not store its "
            f"checkpoint function through _set_gradient_checkpointing, so {stray[0] or 'the model'} "
            "would run torch's checkpoint. Leave the model's checkpointing off and select "
            "its layers: with scopedckpt.checkpointing(model.model.layers): ..."
        )
    return model
