"""Importing the third-party packages of the real-model families, or saying why not.

Each function returns the package or raises :class:`UnavailableError` with what to install;
tests/real_models.py turns that into a skip, ``benchmarks.real_models`` into a note.
Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set on import of this module, before
transformers or huggingface_hub is imported (both read it at import time).

timm imports torchvision at import time (``timm/layers/create_norm.py``,
``timm/layers/norm_act.py``, ``timm/data/transforms.py``) although none of the models
used here use it; where torchvision cannot be imported (not installed, or a CUDA build
next to a CPU torch) :func:`import_timm` imports it with a stand-in torchvision that exists
only during that import (see :func:`_import_timm_without_torchvision`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REAL_EXTRA = "pip install -e '.[real]'"


class UnavailableError(Exception):
    """A family's package is missing or does not import here; the message says why."""


def _forget(package: str) -> None:
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


def _module(name: str, why: str) -> Any:
    """``import name``, or :class:`UnavailableError` saying ``why`` when it is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise UnavailableError(why) from error


def import_transformers() -> Any:
    """Hugging Face transformers, or :class:`UnavailableError`."""
    return _module("transformers", f"needs transformers ({REAL_EXTRA})")


def import_torchvision() -> Any:
    """torchvision, or :class:`UnavailableError`: its wheel may be a CUDA build that fails to
    import next to a CPU torch."""
    try:
        import torchvision
    except Exception as error:  # ImportError, or RuntimeError from a CUDA build's ops
        _forget("torchvision")
        raise UnavailableError(
            f"torchvision does not import here: {type(error).__name__}: {error}"
        ) from error
    return torchvision


class _Placeholder:
    """Any torchvision attribute timm touches while importing: a value, a base, a call."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)  # class MaybeToTensor(transforms.ToTensor) in timm/data


class _FrozenBatchNorm2d(nn.Module):
    """Stands for torchvision.ops.misc.FrozenBatchNorm2d in timm's isinstance checks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision is not installed: FrozenBatchNorm2d is unavailable")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any = _FrozenBatchNorm2d if name == "FrozenBatchNorm2d" else _Placeholder()
        setattr(self, name, value)
        return value


class _StandInTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def _import_timm_without_torchvision() -> None:
    """Import timm with a stand-in torchvision that is gone again afterwards.

    timm 1.0.31 imports torchvision.ops.misc.FrozenBatchNorm2d (layers) and
    torchvision.transforms (timm.data, imported by timm.models) at import time; the
    models used here never call into torchvision. The stand-in lives in sys.modules
    only during ``import timm``, so ``import torchvision`` still fails afterwards.
    """
    _forget("torchvision")
    _forget("timm")
    finder = _StandInTorchvision()
    sys.meta_path.insert(0, finder)
    try:
        import timm  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        _forget("torchvision")


def import_timm() -> Any:
    """timm, or :class:`UnavailableError`; imported with a stand-in torchvision where the real
    one does not import."""
    if importlib.util.find_spec("timm") is None:
        raise UnavailableError(
            f"needs timm ({REAL_EXTRA}; then pip install --no-deps timm==1.0.31)"
        )
    if "timm" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except Exception:
            try:
                _import_timm_without_torchvision()
            except ImportError as error:  # e.g. Pillow missing: timm.data imports PIL
                _forget("timm")
                raise UnavailableError(f"timm does not import: {error}") from error
    return _module("timm", f"needs timm ({REAL_EXTRA})")
