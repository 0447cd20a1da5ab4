"""The one entry of every region call: ask which path it takes, and take it.

:func:`scopedckpt.checkpoint`, ``checkpoint_sequential`` and the forwards of
module targets end here; NOTE [ region paths ] in ``_paths.py`` says which
path a call takes and which module runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ._compiled import compiled_region
from ._engine import _region, region_outside_dynamo
from ._options import DEFAULT_OPTIONS, RegionOptions
from ._paths import BREAK, Path, region_path, where
from ._state import Scope

__all__ = ["run_region"]

R = TypeVar("R")


def run_region(
    fn: Callable[..., R],
    owner: object | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: RegionOptions = DEFAULT_OPTIONS,
    *,
    scope: Scope | None = None,
) -> R:
    """Run ``fn(*args, **kwargs)`` down the path :func:`region_path` names.

    ``owner``: the module whose forward ``fn`` is, if any; ``scope`` forces a
    scope in eager code (integrations).
    """
    path = region_path(scope)
    if path is Path.EAGER:
        if where() is BREAK:  # traced code inside an eager frame: a graph break
            return region_outside_dynamo(fn, owner, args, kwargs, options, scope=scope)
        return _region(fn, owner, args, kwargs, options, scope=scope)
    if path is Path.COMPILED:
        return compiled_region(fn, owner, args, kwargs, options)
    return fn(*args, **kwargs)
