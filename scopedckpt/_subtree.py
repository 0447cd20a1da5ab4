"""The tensors and layers of a module's subtree, listed once per module.

Region mechanisms that look at a region's whole module subtree at every region
(``_written``, ``_early_stop``) read it here: listing a subtree walks every
submodule, and regions start at every step. A listing is made again when any
module registers a parameter, buffer or submodule (torch's global registration
hooks, installed at the first listing), or when the module at that id is
another one.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.parameter import is_lazy

from ._torch_private import module_buffers

__all__ = ["LATE_WRITERS", "subtree"]

# Layers whose ops hand autograd a tensor before writing it (NOTE [ late writes ] in
# _early_stop.py).
LATE_WRITERS: tuple[type[nn.Module], ...] = (nn.RReLU,)


class _Listing:
    """The subtree listings by owner id, valid while no module registered anything."""

    generation = 0
    installed = False
    # owner id -> (weak reference, generation, parameters, holders, late writers)
    by_owner: dict[int, tuple[Any, ...]] = {}  # noqa: RUF012


def _registered(*args: Any) -> None:
    _Listing.generation += 1


def subtree(owner: nn.Module) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[nn.Module, ...]]:
    """The owner's parameters by qualified name, its modules with buffers (by qualified
    name), and its ``LATE_WRITERS`` layers."""
    if not _Listing.installed:
        _Listing.installed = True
        torch_module.register_module_parameter_registration_hook(_registered)
        torch_module.register_module_buffer_registration_hook(_registered)
        torch_module.register_module_module_registration_hook(_registered)
    entry = _Listing.by_owner.get(id(owner))
    if entry is not None and entry[0]() is owner and entry[1] == _Listing.generation:
        return entry[2], entry[3], entry[4]
    parameters = tuple(
        (name, p) for name, p in owner.named_parameters(remove_duplicate=True) if not is_lazy(p)
    )
    modules = tuple(owner.named_modules())
    holders = tuple((name, module) for name, module in modules if module_buffers(module))
    late = tuple(module for _, module in modules if isinstance(module, LATE_WRITERS))
    if len(_Listing.by_owner) >= 4096:
        _Listing.by_owner.clear()
    _Listing.by_owner[id(owner)] = (
        weakref.ref(owner),
        _Listing.generation,
        parameters,
        holders,
        late,
    )
    return parameters, holders, late
