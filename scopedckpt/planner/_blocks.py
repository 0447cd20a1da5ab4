"""Which blocks a plan chooses for: the ones given, in any form ``checkpointing()`` takes as
targets, or the repeated blocks found in the model."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core._errors import ScopedCkptError
from ..core._names import article
from ..core._scope import resolve_targets

__all__ = ["candidates", "find_blocks"]


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks ``plan()`` considers when none are given.

    The rule: among the children of every ``nn.ModuleList`` and ``nn.Sequential``
    in the model (the model itself included) that have submodules of their own,
    the instances of the most frequent class (ties: the class with more
    parameters), outermost only. That is the layers of a transformer
    (``model.h``, ``model.encoder.layer``) and the residual blocks of a ResNet,
    across its stages.

    Example
    -------
    >>> import torch
    >>> layer = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), layer(), layer(), layer())
    >>> [name for name, _ in find_blocks(model)]
    ['1', '2', '3']
    """
    names = {id(m): name for name, m in model.named_modules()}
    by_class: dict[type, list[nn.Module]] = {}
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        for child in module.children():
            if id(child) in seen or not any(True for _ in child.children()):
                continue
            seen.add(id(child))
            by_class.setdefault(type(child), []).append(child)
    if not by_class:
        raise ScopedCkptError(
            f"scopedckpt: plan() found no repeated blocks in {type(model).__name__} (children "
            "of an nn.ModuleList or nn.Sequential that have submodules). Pass blocks=, e.g. "
            "plan(model, x, budget=..., blocks=model.layers)."
        )

    def rank(members: list[nn.Module]) -> tuple[int, int]:
        return len(members), sum(p.numel() for m in members for p in m.parameters())

    members = max(by_class.values(), key=rank)
    inner = {id(sub) for m in members for sub in m.modules() if sub is not m}
    return [(names[id(m)], m) for m in members if id(m) not in inner]


def candidates(model: nn.Module, blocks: Any) -> list[tuple[str, nn.Module]]:
    """``plan(blocks=...)`` as (qualified name, module) pairs: :func:`find_blocks` for None,
    else every module the targets select in ``model``, which must hold them all.

    An ``nn.Sequential`` passed directly stands for its children, as an ``nn.ModuleList``
    does (``blocks=model`` for a Sequential model: its layers); in a list it is one block.
    The model itself is never a block: a region around the whole step saves nothing.

    Example
    -------
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> [name for name, _ in candidates(model, model)]
    ['0', '1']
    """
    if blocks is None:
        return find_blocks(model)
    if isinstance(blocks, nn.Sequential):
        blocks = list(blocks.children())  # what a user means: its layers
    targets = blocks if isinstance(blocks, (list, tuple)) else (blocks,)
    modules, classes, _ = resolve_targets(tuple(targets), model)
    names = {id(m): name for name, m in model.named_modules()}
    chosen = list(modules) + [m for m in model.modules() if classes and isinstance(m, classes)]
    found = []
    for module in dict.fromkeys(chosen):
        if id(module) not in names:
            raise ScopedCkptError(
                f"scopedckpt: plan(blocks=...) names {article(type(module).__name__)} that is not "
                f"a submodule of the model ({type(model).__name__}). Pass blocks of the model "
                "you plan for."
            )
        if module is model:
            raise ScopedCkptError(
                f"scopedckpt: plan(blocks=...) makes the whole model ({type(model).__name__}) "
                "a block, which saves no memory (its recompute rebuilds every activation at "
                f"once). {_blocks_hint(model)}"
            )
        found.append((names[id(module)], module))
    if not found:
        raise ScopedCkptError(
            "scopedckpt: plan(blocks=...) selects no module of the model. Pass modules of "
            "the model, a class of its modules, or leave blocks= out to find its blocks."
        )
    return found


def _blocks_hint(model: nn.Module) -> str:
    """Which ``blocks=`` to pass instead of the model."""
    if isinstance(model, nn.Sequential):
        return "Pass blocks=model itself, not in a list: a Sequential's children are the blocks."
    try:
        found = find_blocks(model)
    except ScopedCkptError:
        found = []
    shown = ", ".join(name for name, _ in found[:3]) + ", ..." * (len(found) > 3)
    default = f", or leave blocks= out (plan() then takes {shown})" if found else ""
    return (
        "Pass the container of its layers (blocks=model.layers, an nn.ModuleList or "
        f"nn.Sequential), their class{default}."
    )
