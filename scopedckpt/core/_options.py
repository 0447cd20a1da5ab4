"""A region call's options: one frozen value, from the public call to torch's checkpoint.

Every way of making a region (:func:`scopedckpt.checkpoint`,
``checkpoint_sequential``, module targets, the integrations, torch's own
``checkpoint`` under ``patch_torch_checkpoint``) builds one
:class:`RegionOptions` and hands it down; each layer reads the fields it
needs, and only :meth:`RegionOptions.torch_keywords` says how they reach
torch. Dynamo traces its construction (a frozen dataclass) as constants.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from ._contexts import ContextFn
from ._torch_private import NOOP_CONTEXT_FN

__all__ = ["DEFAULT_OPTIONS", "DETERMINISM_CHECKS", "RegionOptions"]

# torch's two, and scopedckpt's bitwise verification (NOTE [ bitwise verification ]).
BITWISE = "bitwise"  # the check scopedckpt registers with torch (mechanisms/_verify.py)
DETERMINISM_CHECKS = ("default", "none", BITWISE)


@dataclass(frozen=True)
class RegionOptions:
    """The keywords of :func:`scopedckpt.checkpoint` that shape a region.

    Example
    -------
    >>> from scopedckpt.core._options import RegionOptions
    >>> RegionOptions(determinism_check="none").torch_keywords(compiled=True)
    {'determinism_check': 'none'}
    """

    preserve_rng_state: bool = True
    determinism_check: str = "default"
    early_stop: bool = True
    debug: bool = False
    context_fn: ContextFn | None = None  # the caller's, entered inside scopedckpt's
    save: Any = None  # a save= sequence or a parsed _policy.SavePolicy; None: the scope's
    respect_saved_tensors_hooks: bool | None = None  # torch >= 2.14; None: torch's default

    def torch_keywords(self, *, compiled: bool) -> dict[str, Any]:
        """The keywords torch's checkpoint takes besides ``use_reentrant``, ``context_fn``
        and ``preserve_rng_state``, which each path sets itself.

        ``compiled``: only those that differ from torch's defaults (dynamo handles
        fewer keywords); otherwise all of them.
        """
        keywords: dict[str, Any] = {}
        if not compiled or self.determinism_check != "default":
            keywords["determinism_check"] = self.determinism_check
        if not compiled:  # compiled regions recompute in the backward graph, whole
            keywords["early_stop"] = self.early_stop
        if compiled and self.debug:
            keywords["debug"] = True
        if self.respect_saved_tensors_hooks is not None:  # torch >= 2.14 (checked by checkpoint())
            keywords["respect_saved_tensors_hooks"] = self.respect_saved_tensors_hooks
        return keywords

    @property
    def caller_context_fn(self) -> ContextFn | None:
        """The caller's ``context_fn``; None where there is none or it is torch's no-op
        default."""
        context_fn = self.context_fn
        return None if context_fn is NOOP_CONTEXT_FN else context_fn

    @functools.cached_property
    def eager_keywords(self) -> dict[str, Any]:
        """The keywords an eager region hands torch's checkpoint besides ``fn``, its
        arguments and ``context_fn``: computed once per options value (read-only)."""
        keywords = self.torch_keywords(compiled=False)
        keywords["use_reentrant"] = False
        # scopedckpt stashes more generators than torch does itself (NOTE [ RNG replay ]).
        keywords["preserve_rng_state"] = False
        return keywords

    def in_scope(self, scope_check: str) -> RegionOptions:
        """These options with the scope's ``determinism_check`` where they leave it at
        ``"default"``."""
        if scope_check == "default" or self.determinism_check != "default":
            return self
        return dataclasses.replace(self, determinism_check=scope_check)


DEFAULT_OPTIONS = RegionOptions()
