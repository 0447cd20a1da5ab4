"""The tensors and layers of a module's subtree, listed once per module.

Region mechanisms that look at a region's whole module subtree at every region
(the buffer guard, ``_written``, ``_early_stop``, ``_world``) read it here: listing a
subtree walks every submodule, and regions start at every step. A listing is made again
when any module registers a parameter, buffer or submodule (torch's global registration
hooks, installed at the first listing), or when the module at that id is another one;
what a mechanism learns about a subtree (``Listing.written_parameters``) goes with its
listing. A listing refers to modules weakly and goes when its module goes: it keeps no
model alive.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.nn.parameter import is_lazy

from ._torch_private import module_buffers, module_hooks, module_parameters

__all__ = [
    "LATE_WRITERS",
    "Listing",
    "attribute_places",
    "current_parameters",
    "generators_in",
    "guarded",
    "may_write_parameters",
    "self_guarded",
    "subtree",
]


# The forwards that keep their modules' buffers themselves (scoped batch norm).
_SELF_GUARDED: set[Callable[..., Any]] = set()
# _class_kind's answers by id(class), each beside a weak reference to its class whose
# callback removes the entry when the class goes: classes made at run time can go,
# and an id is never reused while its entry is here. (A WeakKeyDictionary makes a
# weak reference at every lookup, and the guard looks up every module call.)
_CLASSES: dict[int, tuple[bool | None, weakref.ref[type]]] = {}


def self_guarded(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a forward that keeps its module's buffers itself (scoped batch norm): the
    buffer guard leaves its calls and its buffers alone."""
    _SELF_GUARDED.add(forward)
    _CLASSES.clear()
    return forward


def _class_kind(cls: type) -> bool | None:
    """Per class: None if its forward guards itself, else whether it is ``Stateful``.

    Cached in ``_CLASSES``, which ``guarded`` reads first: the buffer guard's global hook
    asks at every module call of a first forward. Whether an instance has buffers is asked of the instance each time: buffers
    come and go (a module may register one after construction).
    """
    forward = getattr(cls, "forward", None)
    kind = None if forward in _SELF_GUARDED else callable(getattr(cls, "scopedckpt_restore", None))
    # When the class goes, the callback pops its entry (the dead reference is pop's default).
    _CLASSES[id(cls)] = (kind, weakref.ref(cls, functools.partial(_CLASSES.pop, id(cls))))
    return kind


def guarded(module: nn.Module) -> bool:
    """Whether the buffer guard guards calls of ``module`` (NOTE [ buffer guard ]): it has
    buffers or is Stateful, and its forward does not guard itself."""
    entry = _CLASSES.get(id(type(module)))
    kind = entry[0] if entry is not None else _class_kind(type(module))
    return kind is not None and (kind or bool(module_buffers(module)))


# Layers whose ops hand autograd a tensor before writing it (NOTE [ late writes ] in
# _early_stop.py).
LATE_WRITERS: tuple[type[nn.Module], ...] = (nn.RReLU,)


@dataclass(slots=True, eq=False)
class Listing:
    """One module's subtree, as it was when listed."""

    owner: weakref.ref[nn.Module]
    generation: int
    # The qualified names of its parameters (lazy ones left out), and for each where the
    # subtree registers it, as (module, name): the tensor itself is looked up there at
    # each use (a recompute swaps copies in, and may list the subtree meanwhile).
    parameters: tuple[str, ...]
    slots: tuple[tuple[tuple[weakref.ref[nn.Module], str], ...], ...]
    # the indices of the parameters a module registering them may write in its forward
    # (any but torch's and scopedckpt's own layers, and embeddings with max_norm)
    writable: tuple[int, ...]
    # the modules the buffer guard guards (scoped batch norm keeps its own buffers)
    guarded: tuple[weakref.ref[nn.Module], ...]
    late: tuple[weakref.ref[nn.Module], ...]  # its LATE_WRITERS layers
    # _generators: its modules' attributes that held generators (NOTE [ explicit
    # generators ]; followed at each use: they may be reassigned)
    generators: tuple[tuple[weakref.ref[nn.Module], str], ...]
    # _world: each non-empty _parameters and _buffers dict of the subtree's modules, and
    # the modules (NOTE [ forward's world ] in _world.py)
    registrations: tuple[dict[str, Any], ...]
    modules: tuple[weakref.ref[nn.Module], ...]
    # _hooks: every module's forward pre-hook and hook dicts, empty or not (NOTE [ hooks
    # in recomputes ] in _hooks.py: hooks come and go without a registration)
    hook_dicts: tuple[dict[int, Any], ...]
    # _written: the parameters (indices) regions over this module were seen to change, and
    # whether they still copy all that may be changed (until one is recomputed)
    written_parameters: frozenset[int] = frozenset()
    learning: bool = True
    # _written: the parameters as registered at a first forward with no copies swapped in
    objects: tuple[Tensor, ...] | None = None


class _Listing:
    """The subtree listings by owner id, valid while no module registered anything."""

    generation = 0
    installed = False
    by_owner: dict[int, Listing] = {}  # noqa: RUF012


def _registered(*args: Any) -> None:
    _Listing.generation += 1


def _buffer_registered(module: nn.Module, name: str, tensor: Any) -> None:
    """A buffer registered again under its name (``self.steps += 1`` assigns the buffer)
    changes no listing, which names buffers: only a new name, or None becoming a tensor or
    back, does."""
    if tensor is None or module_buffers(module).get(name) is None:
        _Listing.generation += 1


def _forget(key: int, gone: weakref.ref[nn.Module]) -> None:
    """The owner of the listing at ``key`` went: the listing goes too (if it is still its)."""
    entry = _Listing.by_owner.get(key)
    if entry is not None and entry.owner is gone:
        del _Listing.by_owner[key]


# Where torch's and scopedckpt's own layers are defined: their forwards write no
# parameter, but for these.
_OWN_LAYERS = ("torch.nn.modules.", "scopedckpt.")


# Stands for a parameter whose module went: its version never moves.
_GONE = torch.empty(0)


def current_parameters(listing: Listing) -> tuple[Tensor, ...]:
    """The parameters a listing names, as registered now (``_GONE`` where their module
    went)."""
    found: list[Tensor] = []
    for slots in listing.slots:
        module = slots[0][0]()
        p = None if module is None else module_parameters(module).get(slots[0][1])
        found.append(_GONE if p is None else p)
    return tuple(found)


def may_write_parameters(module: nn.Module) -> bool:
    """Whether ``module``'s forward may change its parameters in place: any module but
    torch's and scopedckpt's own layers, embeddings with ``max_norm`` (renormalized rows)
    and recurrent layers (``flatten_parameters``) among them."""
    if not type(module).__module__.startswith(_OWN_LAYERS):
        return True
    return getattr(module, "max_norm", None) is not None or isinstance(module, nn.RNNBase)


def attribute_places(
    modules: Iterable[nn.Module],
) -> tuple[tuple[weakref.ref[nn.Module], str], ...]:
    """The attributes of ``modules`` holding a generator, or a list, tuple or dict with
    one (NOTE [ explicit generators ] in ``_generators.py``: followed at each region).

    Example
    -------
    >>> block = nn.Linear(2, 2)
    >>> block.noise = torch.Generator()
    >>> [name for _, name in attribute_places([block])]
    ['noise']
    """
    places: list[tuple[weakref.ref[nn.Module], str]] = []
    for module in modules:
        for name, value in vars(module).items():
            if generators_in(value):
                places.append((weakref.ref(module), name))
    return tuple(places)


def generators_in(value: object) -> list[torch.Generator]:
    """``value`` if it is a generator, else the generators among its items (one level)."""
    kind = type(value)
    if kind is torch.Generator:
        return [value]  # type: ignore[list-item]
    if kind is dict:
        value = value.values()  # type: ignore[attr-defined]
    elif kind is not list and kind is not tuple:
        return []
    return [item for item in value if type(item) is torch.Generator]  # type: ignore[attr-defined]


def subtree(owner: nn.Module) -> Listing:
    """The listing of ``owner``'s subtree, made again when any module registered anything."""
    entry = _Listing.by_owner.get(id(owner))
    if entry is not None and entry.owner() is owner and entry.generation == _Listing.generation:
        return entry
    if not _Listing.installed:  # at the first listing: none is valid before it
        _Listing.installed = True
        torch_module.register_module_parameter_registration_hook(_registered)
        torch_module.register_module_buffer_registration_hook(_buffer_registered)
        torch_module.register_module_module_registration_hook(_registered)
    named = tuple(
        (name, p) for name, p in owner.named_parameters(remove_duplicate=True) if not is_lazy(p)
    )
    parameters = tuple(name for name, _ in named)
    modules = tuple(owner.named_modules())
    weak = {id(module): weakref.ref(module) for _, module in modules}
    registered: dict[int, list[tuple[weakref.ref[nn.Module], str]]] = {}
    writers: set[int] = set()
    for _, module in modules:
        writes = may_write_parameters(module)
        for name, p in module_parameters(module).items():
            if p is not None:
                registered.setdefault(id(p), []).append((weak[id(module)], name))
                if writes:
                    writers.add(id(p))
    slots = tuple(tuple(registered[id(p)]) for _, p in named)
    writable = tuple(i for i, (_, p) in enumerate(named) if id(p) in writers)
    guarded_modules = tuple(weak[id(m)] for _, m in modules if guarded(m))
    late = tuple(weak[id(m)] for _, m in modules if isinstance(m, LATE_WRITERS))
    registrations = tuple(
        d for _, m in modules for d in (module_parameters(m), module_buffers(m)) if d
    )
    generators = attribute_places(module for _, module in modules)
    if len(_Listing.by_owner) >= 4096:
        _Listing.by_owner.clear()
    forget = functools.partial(_forget, id(owner))
    listing = Listing(
        weakref.ref(owner, forget),
        _Listing.generation,
        parameters,
        slots,
        writable,
        guarded_modules,
        late,
        generators,
        registrations,
        tuple(weak[id(m)] for _, m in modules),
        tuple(d for _, m in modules for d in module_hooks(m)),
    )
    _Listing.by_owner[id(owner)] = listing
    return listing
