"""Where a module subtree, and the code its modules run, hold a ``torch.Generator``: found
without running anything, as places a region follows again each time it starts.

NOTE [ generator places ]
=========================
A region stashes the explicit generators it can reach before it runs (NOTE
[ explicit generators ] in ``_generators.py``). What it can reach is searched
once per subtree listing (``_subtree.py``) and per region function's code, on
two sides:

* data: each attribute of each module of the subtree (not torch's own
  bookkeeping), its forward hooks and the global ones (registered before the
  listing), and each class attribute of their classes, followed through
  lists, tuples, dicts (their first ``_ITEMS`` elements), partials, bound
  methods, the attributes of plain objects and of modules outside the
  subtree, up to ``DEPTH`` steps and ``_BUDGET`` objects;
* code: every function of those classes, and of the classes of the plain
  objects met, followed through the names their code reads: global and
  module-level generators, functions and classes (and their functions, so a
  helper's global is found), objects, closure cells and default values, and
  the code nested in them, up to ``_NESTING`` functions and classes deep (a
  search stays far from Python's recursion limit).

The code and classes of torch, scopedckpt, Python's standard library and
installed packages (site-packages) are not followed: they are large (a
Hugging Face model's code reaches most of ``transformers``, about 200 ms per
search). Their objects' attributes are still searched; a generator that only an
installed library's code reads as a global is left to verified calls' watch. Each
generator is recorded as a *place*: what the search started from (a module, a
class or a function, held weakly, so a listing keeps no model alive) and the
steps from there. A region follows the places again, so a reassigned
attribute or element is the new generator.

A forward that makes a generator and keeps it where the module held None or
an empty list has it made again by every recompute (NOTE [ generator slots ]
in ``_slots.py``).

The search also notes whether the code it looks at names generators: the
first forwards of regions running such code are watched (NOTE [ watched
code ] in ``_generators.py``), which finds a generator no place held when
the subtree was listed (one a helper makes and keeps in a new attribute) at
its first use.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ._torch_private import GLOBAL_POST_HOOKS, GLOBAL_PRE_HOOKS

__all__ = [
    "ATTR",
    "BOOKKEEPING",
    "DEPTH",
    "ITEM",
    "Place",
    "follow",
    "foreign",
    "function_places",
    "names_generators",
    "namespace_of",
    "subtree_places",
]

# How the steps of a place read: an attribute from __dict__ (so no property runs), an
# item ([key]), or a special attribute (getattr: __closure__, cell_contents, ...).
ATTR, ITEM, _SPECIAL = 0, 1, 2
Step = tuple[int, Any]
# A weak reference to where the search started (None: the region's own function,
# given at lookup), and the steps from there.
Place = tuple["weakref.ref[Any] | None", tuple[Step, ...]]

DEPTH = 8  # steps followed from where a search starts, globals' two included
_BUDGET = 5_000  # objects, functions and classes a search visits, at most
_ITEMS = 1024  # elements looked at per list, tuple or dict
_NESTING = 24  # classes and functions found through one another (the stack stays short)

# Values that hold nothing.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
# torch's per-module bookkeeping (parameters, buffers and hooks): no generator is there,
# and a subtree's own submodules are listed themselves.
BOOKKEEPING = frozenset(vars(nn.Module()))
_NOT_FOLLOWED = frozenset({"torch", "scopedckpt", *sys.stdlib_module_names})


def foreign(thing: object) -> bool:
    """Whether a function, class or Python module is another library's: torch's,
    scopedckpt's, the standard library's or an installed package's (site-packages)."""
    name = (
        thing.__name__
        if isinstance(thing, types.ModuleType)
        else getattr(thing, "__module__", None)
    )
    if not isinstance(name, str):
        return True
    foreign = _FOREIGN.get(name)
    if foreign is None:
        path = getattr(sys.modules.get(name), "__file__", None) or ""
        foreign = name.partition(".")[0] in _NOT_FOLLOWED or any(
            part in _INSTALLED for part in path.replace("\\", "/").split("/")
        )
        if len(_FOREIGN) >= 4096:
            _FOREIGN.clear()
        _FOREIGN[name] = foreign
    return foreign


# Whether the Python module of each name is another library's (_foreign), once asked.
_FOREIGN: dict[str, bool] = {}
_INSTALLED = frozenset({"site-packages", "dist-packages"})


class _Search:
    """One search; its places, in the order found."""

    def __init__(self, listed: Iterable[nn.Module] = ()) -> None:
        self.places: list[Place] = []
        self.listed = {id(m) for m in listed}
        self.seen: set[int] = set()
        self.alive: list[object] = []  # what was seen stays alive while ids are compared
        self.budget = _BUDGET
        self.nesting = 0
        self.draws = False  # some code searched names a generator (:func:`names_generators`)

    def value(self, value: object, root: weakref.ref[Any] | None, steps: tuple[Step, ...]) -> None:
        """Record ``value`` if it is a generator; else look inside it."""
        kind = type(value)
        if kind is torch.Generator:
            self.places.append((root, steps))
            return
        if kind in _ATOMS or isinstance(value, torch.Tensor) or id(value) in self.seen:
            return
        if isinstance(value, types.FunctionType):
            self.function(value)
            return
        if isinstance(value, type):
            self.cls(value)
            return
        if len(steps) >= DEPTH or self.budget <= 0 or isinstance(value, types.ModuleType):
            return
        self.seen.add(id(value))
        self.alive.append(value)
        self.budget -= 1
        if kind is list or kind is tuple:
            for index, item in enumerate(value[:_ITEMS]):  # type: ignore[index]
                self.value(item, root, (*steps, (ITEM, index)))
        elif isinstance(value, dict):
            for key, item in list(dict.items(value))[:_ITEMS]:  # no override runs
                self.value(item, root, (*steps, (ITEM, key)))
        elif kind is functools.partial:
            self.value(value.func, root, (*steps, (_SPECIAL, "func")))  # type: ignore[attr-defined]
            self.value(value.args, root, (*steps, (_SPECIAL, "args")))  # type: ignore[attr-defined]
            self.value(value.keywords, root, (*steps, (_SPECIAL, "keywords")))  # type: ignore[attr-defined]
        elif kind is types.MethodType:
            self.value(value.__func__, root, steps)  # type: ignore[attr-defined]
            self.value(value.__self__, root, (*steps, (_SPECIAL, "__self__")))  # type: ignore[attr-defined]
        elif isinstance(value, nn.Module):
            if id(value) not in self.listed:
                self.attributes(value, root, steps)
                for name, child in list(value._modules.items()):
                    self.value(child, root, (*steps, (ATTR, "_modules"), (ITEM, name)))
                self.cls(type(value))
        else:
            namespace = namespace_of(value)
            if type(namespace) is dict:
                self.attributes(value, root, steps)
                self.cls(type(value))

    def attributes(
        self, holder: object, root: weakref.ref[Any] | None, steps: tuple[Step, ...]
    ) -> None:
        """Look at each attribute in ``holder.__dict__`` but torch's module bookkeeping."""
        for name, item in list(namespace_of(holder).items()):
            if name not in BOOKKEEPING:
                self.value(item, root, (*steps, (ATTR, name)))

    def cls(self, kind: type) -> None:
        """Look at the attributes and code of ``kind`` and its bases (but foreign ones)."""
        if self.nesting >= _NESTING:
            return
        self.nesting += 1
        try:
            self._cls(kind)
        finally:
            self.nesting -= 1

    def _cls(self, kind: type) -> None:
        for base in kind.__mro__:
            if id(base) in self.seen or self.budget <= 0 or foreign(base):
                continue
            self.seen.add(id(base))
            self.budget -= 1
            root = weakref.ref(base)
            for name, item in list(vars(base).items()):
                if isinstance(item, (staticmethod, classmethod)):
                    item = item.__func__
                elif isinstance(item, property):
                    for accessor in (item.fget, item.fset):
                        if isinstance(accessor, types.FunctionType):
                            self.function(accessor)
                    continue
                if isinstance(item, types.FunctionType):
                    self.function(item)
                elif not (name.startswith("__") and name.endswith("__")):
                    self.value(item, root, ((ATTR, name),))

    def function(self, function: types.FunctionType) -> None:
        """Look at what ``function``'s code reads, its closure and its defaults."""
        if (
            id(function) in self.seen
            or self.budget <= 0
            or self.nesting >= _NESTING
            or foreign(function)
        ):
            return
        self.seen.add(id(function))
        self.alive.append(function)
        self.budget -= 1
        self.nesting += 1
        try:
            self._function(function)
        finally:
            self.nesting -= 1

    def _function(self, function: types.FunctionType) -> None:
        root = weakref.ref(function)
        for index, cell in enumerate(function.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            steps = ((_SPECIAL, "__closure__"), (ITEM, index), (_SPECIAL, "cell_contents"))
            self.value(contents, root, steps)
        self.defaults_and_code(function, root)

    def defaults_and_code(
        self, function: types.FunctionType, root: weakref.ref[Any] | None
    ) -> None:
        """Look at ``function``'s default values and at what its code reads."""
        for index, default in enumerate(function.__defaults__ or ()):
            self.value(default, root, ((_SPECIAL, "__defaults__"), (ITEM, index)))
        for name, default in (function.__kwdefaults__ or {}).items():
            self.value(default, root, ((_SPECIAL, "__kwdefaults__"), (ITEM, name)))
        self.code(function.__code__, function.__globals__, root, set())

    def code(
        self,
        code: types.CodeType,
        namespace: dict[str, Any],
        root: weakref.ref[Any] | None,
        done: set[int],
    ) -> None:
        """The names ``code`` (and the code nested in it) reads from ``namespace``."""
        if id(code) in done:
            return
        done.add(id(code))
        if not self.draws and names_generators(code):
            self.draws = True
        names = code.co_names
        for name in names:
            if name not in namespace:
                continue  # a builtin, an attribute name, or not defined (yet)
            item = namespace[name]
            steps: tuple[Step, ...] = ((_SPECIAL, "__globals__"), (ITEM, name))
            if isinstance(item, types.ModuleType):
                if foreign(item):
                    continue
                # module.name: each name the code reads, looked up in the module
                inside = vars(item)
                for attribute in names:
                    if attribute in inside:
                        self.value(inside[attribute], root, (*steps, (ATTR, attribute)))
            else:
                self.value(item, root, steps)
        for constant in code.co_consts:
            if isinstance(constant, types.CodeType):
                self.code(constant, namespace, root, done)


# The names by which code passes (``generator=g``, ``def f(x, generator)``), reads
# (``self.generator``) or makes (``torch.Generator``) a generator.
_GENERATOR_NAMES = frozenset({"generator", "Generator"})


def names_generators(code: types.CodeType) -> bool:
    """Whether ``code`` itself names a generator: a ``generator`` keyword argument,
    parameter, variable or attribute, or ``Generator`` (NOTE [ watched code ])."""
    return (
        not _GENERATOR_NAMES.isdisjoint(code.co_names)
        or not _GENERATOR_NAMES.isdisjoint(code.co_varnames)
        # keyword names of calls are tuples of strings among the constants
        or any(type(c) is tuple and not _GENERATOR_NAMES.isdisjoint(c) for c in code.co_consts)
    )


def namespace_of(value: object) -> Any:
    """``value.__dict__`` (a class's mapping proxy), or None; no ``__getattr__`` or
    ``__getattribute__`` of its class runs."""
    try:
        return object.__getattribute__(value, "__dict__")
    except Exception:
        return None


def subtree_places(modules: Iterable[nn.Module]) -> tuple[tuple[Place, ...], bool]:
    """The places of the generators a subtree of ``modules`` holds or its code reads, and
    whether that code names generators (NOTE [ watched code ])."""
    modules = list(modules)
    search = _Search(modules)
    for module in modules:
        root = weakref.ref(module)
        search.attributes(module, root, ())
        search.cls(type(module))
        for name in _FORWARD_HOOKS:  # they run inside the module's call
            hooks = getattr(module, name, None)
            if isinstance(hooks, dict):
                for key, hook in list(hooks.items()):
                    search.value(hook, root, ((ATTR, name), (ITEM, key)))
    for hooks in (GLOBAL_PRE_HOOKS, GLOBAL_POST_HOOKS):  # every module call runs them
        for hook in list(hooks.values()):
            try:
                search.value(hook, weakref.ref(hook), ())
            except TypeError:  # no weak reference to it, so no place (functions take them)
                continue
    return tuple(search.places), search.draws


# A module's own forward hooks (torch's names for them).
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")


def function_places(function: types.FunctionType) -> tuple[tuple[Place, ...], bool]:
    """The places of the generators ``function`` (a region's, not torch's) reads through
    its code and defaults and the code that reaches, and whether that code names
    generators (NOTE [ watched code ]); places that start at ``function`` itself have no
    reference (:func:`follow` is given it). Its closure is left out: it is another object
    for each function made from the same code."""
    if foreign(function):
        return (), False
    search = _Search()
    search.seen.add(id(function))
    search.defaults_and_code(function, None)
    return tuple(search.places), search.draws


def follow(place: Place, start: object = None) -> torch.Generator | None:
    """The generator at ``place`` now, if one is there (``start``: what a place with no
    reference starts from)."""
    reference, steps = place
    value = start if reference is None else reference()
    for kind, key in steps:
        if value is None:
            return None
        if kind == ATTR:
            namespace = namespace_of(value)
            value = None if namespace is None else namespace.get(key)
        elif kind == ITEM:
            try:
                value = value[key]  # type: ignore[index]
            except (LookupError, TypeError):
                return None
        else:
            value = getattr(value, key, None)
    return value if type(value) is torch.Generator else None
