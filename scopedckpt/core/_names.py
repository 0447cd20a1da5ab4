"""How error messages name regions and modules: by qualified path where the scope knows it.

NOTE [ naming ]
===============
A message names a module by its qualified path wherever the scope can know one,
looked up only when an error is raised, in these models, first hit wins:

1. the scope's ``root=`` (or the model of a :class:`scopedckpt.Plan` target):
   ``'blocks.1' (Block)``; the root itself is ``the root model (Net)``;
2. the module targets of this and the enclosing ``checkpointing(...)`` calls, and
   the ``nn.ModuleList`` / ``nn.ModuleDict`` targets, less those inside another
   one (a block inside the model given too is named in the model). The only
   one, a module: ``'blocks.1' (Block)``, and the module itself ``the module given
   to checkpointing() (Net)``; a container, or one of several:
   ``'1' in the ModuleList given to checkpointing() (Block)``;
3. the region's own module, for a module inside it whose region has no path:
   ``'drop' in a Block module (Dropout; pass root=...)``.

Elsewhere (a class target's instance without ``root=``) a module is ``a Block
module (pass root=model to checkpointing() for its path)``, and a region that
runs a plain function is the function's qualified name followed by how to get a
path (checkpoint a module). The first line of a message (up to its first
newline) says what happened, in which region, and the most likely fix; details
follow on later lines.
"""

from __future__ import annotations

import functools
import os
import traceback
import types
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ._state import Frame, RegionCall, Scope

__all__ = [
    "article",
    "describe",
    "frame_region_name",
    "innermost_user_frame",
    "layer_of",
    "layer_place",
    "module_path",
    "module_region",
    "region_name",
    "region_name_of",
]

# Where code is not the user's, for messages naming the user's source line: torch,
# scopedckpt (every subpackage) and the standard library.
LIBRARY_SOURCES = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(__file__)) + os.sep,
    os.path.dirname(functools.__file__) + os.sep,
)


ROOT_HINT = "pass root=model to checkpointing() for its path"
FUNCTION_HINT = "checkpoint a module to name it by its path"
# Letters whose spoken name starts with a vowel: an LSTM, an RNN, an MLP (but a GRU).
_VOWEL_LETTERS = frozenset("AEFHILMNORSX")
# Words starting with a 'u' spoken as 'you': a UserDict, a Unit.
_YOU = ("uni", "use", "usa", "usu", "uti", "ure")


def innermost_user_frame(tb: types.TracebackType | None) -> tuple[types.FrameType, int] | None:
    """The innermost entry (frame, line) of traceback ``tb`` whose code is outside
    ``LIBRARY_SOURCES``, or None: for an error torch raised, the user's call into torch."""
    found = None
    for frame, line in traceback.walk_tb(tb):
        if not frame.f_code.co_filename.startswith(LIBRARY_SOURCES):
            found = frame, line
    return found


def article(word: str) -> str:
    """``word`` with its indefinite article, as spoken: an int, an LSTM, a Linear."""
    bare = word.lstrip("_")
    if not bare:
        return f"a {word}"
    if len(bare) > 1 and bare[0].isupper() and bare[1].isupper():  # an acronym, spelled
        vowel = bare[0] in _VOWEL_LETTERS
    else:
        lower = bare.lower()
        vowel = lower[0] in "aeio" or (lower[0] == "u" and not lower.startswith(_YOU))
    return f"{'an' if vowel else 'a'} {word}"


def describe(owner: object) -> str:
    """A short name for error messages: the class and the torch ``repr`` details."""
    extra = getattr(owner, "extra_repr", None)
    details = extra() if callable(extra) else ""
    name = getattr(owner, "__qualname__", None) or type(owner).__name__
    return f"{name}({details})" if details or not callable(owner) else name


def region_name(call: RegionCall) -> str:
    """Name a region for an error message: the forward of its owner where it has one, else
    its module or function (NOTE [ naming ])."""
    return region_name_of(call.owner, call.label, call.scope)


def region_name_of(owner: object | None, label: object, scope: Scope | None) -> str:
    """:func:`region_name` from a region's owner, label and scope: ``the forward of
    'blocks.1' (Block)``, ``'blocks.1' (Block)`` for a module called as a function,
    ``Block.attend of 'blocks.1' (Block)`` for a bound method, or a function's name and
    how to get a path."""
    if owner is not None:
        return f"the forward of {module_path(owner, None, scope)}"
    if isinstance(label, nn.Module):
        return module_path(label, None, scope)
    module = layer_of(label)
    if module is not None:
        function = label.func if isinstance(label, functools.partial) else label
        return f"{describe(function)} of {module_path(module, None, scope)}"
    return f"{describe(label)} (a function: {FUNCTION_HINT})"


def frame_region_name(frame: Frame) -> str:
    """The region a frame runs, as in ``the recompute of region 'blocks.1' (Block)``: a
    frame knows its owner, not its function."""
    if frame.owner is not None:
        return module_region(frame.owner, frame.scope)
    return f"a function's region ({FUNCTION_HINT})"


def module_region(module: object, scope: Scope | None) -> str:
    """The region of ``module``'s forward: ``region 'blocks.1' (Block)``, or ``the region
    of a Block module (...)`` where it has no path."""
    name = module_path(module, None, scope)
    return f"region {name}" if name.startswith("'") else f"the region of {name}"


def module_path(module: object, frame: Frame | None, scope: Scope | None = None) -> str:
    """Name ``module`` for an error message: its qualified path where the scope knows one
    (NOTE [ naming ]), else its class and how to get a path."""
    kind = type(module).__name__
    found = _place(module, frame, scope)
    if found is None:
        return f"{article(kind)} module ({ROOT_HINT})"
    place, known = found
    return f"{place} ({kind})" if known else f"{place} ({kind}; {ROOT_HINT})"


def layer_place(module: object, frame: Frame) -> str | None:
    """Where a layer a frame runs is, for ``Frame.name``: ``'blocks.1.drop'``, or None."""
    found = _place(module, frame, None) if isinstance(module, nn.Module) else None
    return None if found is None else found[0]


def _place(module: object, frame: Frame | None, scope: Scope | None) -> tuple[str, bool] | None:
    """``module``'s path and what it is relative to, without its class, and whether that is
    known to the scope (not only to its region's module, which has no path); None if
    unknown."""
    scope = frame.scope if frame is not None else scope
    if scope is not None:
        for model, where, itself in _models(scope):
            if model is module:
                if itself:
                    return itself, True
                continue
            for name, candidate in model.named_modules():
                if candidate is module:
                    return f"'{name}'{where}", True
    owner = None if frame is None else frame.owner
    if isinstance(owner, nn.Module) and owner is not module:
        for name, candidate in owner.named_modules():
            if candidate is module:
                return f"'{name}' in {article(type(owner).__name__)} module", False
    return None


def _models(scope: Scope) -> list[tuple[Any, str, str]]:
    """The models paths are relative to (NOTE [ naming ]), each with what follows a path
    in it and the name of the model itself ("" for none)."""
    given: dict[int, Any] = {}
    for target in (*scope.containers, *scope.keep):
        given.setdefault(id(target), target)
    candidates = ([scope.root] if scope.root is not None else []) + list(given.values())
    inside: set[int] = set()
    for candidate in candidates:
        inside.update(id(m) for m in candidate.modules() if m is not candidate)
    tops = [c for c in given.values() if id(c) not in inside and c is not scope.root]
    models: list[tuple[Any, str, str]] = []
    if scope.root is not None:
        models.append((scope.root, "", "the root model"))
    alone = len(tops) == 1 and scope.root is None
    for top in tops:
        if alone and not isinstance(top, (nn.ModuleList, nn.ModuleDict)):
            models.append((top, "", "the module given to checkpointing()"))
        else:
            models.append((top, f" in the {type(top).__name__} given to checkpointing()", ""))
    return models


def layer_of(function: object) -> nn.Module | None:
    """The layer of a bound method, or of ``partial(forward, layer, ...)`` (how Hugging Face
    hands its layers to a checkpoint function), else None."""
    if isinstance(function, functools.partial):
        first = function.args[0] if function.args else None
        return first if isinstance(first, nn.Module) else None
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None
