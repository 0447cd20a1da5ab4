"""``scopedckpt.plan()``: which blocks to recompute, and how, to fit a memory budget
fastest; and the :class:`Plan` that ``checkpointing(plan)`` applies.

A plan only picks, per block, no region, a full region or a region with a
``save=`` preset: each of those is exact, so training under any plan is
bit-for-bit training without checkpointing. docs/memory-budget.md says how to
pick a budget and what the table means; NOTE [ peak model ] (``_profile.py``)
and NOTE [ planning as a dynamic program ] (``_solve.py``) say how it is made.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core._errors import ScopedCkptError
from ..core._names import article
from ..mechanisms._report import text_table
from ._blocks import candidates
from ._budget import format_bytes, parse_budget
from ._peak import remember
from ._profile import PRESETS, Profile, default_loss, profile_step
from ._solve import solve

__all__ = ["Plan", "PlannedBlock", "choose", "format_table", "plan"]

_FORMAT = 2  # the version of Plan.to_json's format
# The Plan fields to_json stores as they are, each with the type from_json reads it as.
_STORED: dict[str, Callable[[Any], Any]] = {
    "budget": int,
    "peak": int,
    "no_checkpoint_peak": int,
    "smallest_budget": int,
    "step_cost": int,
    "added_cost": int,
    "step_seconds": float,
    "costs": str,
    "optimal": bool,
}


@dataclass(frozen=True)
class PlannedBlock:
    """One block of a :class:`Plan`: what it runs as, keeps and costs."""

    name: str  # qualified name in the model
    kind: str  # class name
    choice: str  # "none", "full" or a preset of scopedckpt.policies ("matmuls", ...)
    kept_bytes: int  # predicted bytes kept from its forward to its backward
    recompute_cost: int  # predicted cost added to a step (NOTE [ counted costs ])
    module: nn.Module | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Plan:
    """Which blocks are regions, and with which ``save=`` preset, for one memory budget.

    Made by :func:`plan`; applied by ``checkpointing(plan)``; printed as a table;
    stored with :meth:`to_json` and loaded with :meth:`from_json`. All sizes are
    bytes as NOTE [ live bytes ] counts them; costs are counted, not timed, in
    nanoseconds at the assumed constants of the device type ``costs`` (NOTE
    [ counted costs ]): they decided the plan. Times are seconds: the step's as
    measured while planning, and costs scaled by it (``seconds_per_cost``).

    Example
    -------
    >>> import torch, scopedckpt
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(
    ...     torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)])
    >>> x = torch.randn(512, 64)
    >>> plan = scopedckpt.plan(model, x, budget=0.75)
    >>> plan.peak <= plan.budget
    True
    >>> with scopedckpt.checkpointing(plan):
    ...     loss = model(x).sum()
    >>> loss.backward()
    """

    blocks: tuple[PlannedBlock, ...]
    budget: int
    peak: int  # predicted peak of a step under the plan
    no_checkpoint_peak: int
    smallest_budget: int
    step_cost: int  # a step without checkpointing
    added_cost: int  # what the plan's recomputes add to it
    step_seconds: float  # a step without checkpointing, as timed (counted) while planning
    costs: str  # the device type whose constants priced the costs ("cpu", "cuda")
    optimal: bool
    unused: tuple[str, ...] = ()  # candidate blocks the example step did not run
    planning_seconds: float = 0.0
    model: nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def regions(self) -> list[tuple[nn.Module, tuple[Any, ...] | None]]:
        """The blocks that are regions, each with its ``save=`` items (None: full)."""
        chosen = []
        for block in self.blocks:
            if block.choice == "none":
                continue
            if block.module is None:
                raise ScopedCkptError(
                    "scopedckpt: this plan is not bound to a model; load it with "
                    "Plan.from_json(text, model)."
                )
            chosen.append((block.module, None if block.choice == "full" else PRESETS[block.choice]))
        return chosen

    def __checkpoint_regions__(
        self,
    ) -> tuple[nn.Module | None, list[tuple[nn.Module, tuple[Any, ...] | None]]]:
        """What ``checkpointing(plan)`` reads: the model, and :attr:`regions`."""
        return self.model, self.regions

    @property
    def overhead(self) -> float:
        """Predicted step time under the plan over the step without checkpointing, from
        the costs alone."""
        return (self.step_cost + self.added_cost) / max(self.step_cost, 1)

    @property
    def seconds_per_cost(self) -> float:
        """The step's measured time over its cost: what reports costs as time."""
        return self.step_seconds / max(self.step_cost, 1)

    def __str__(self) -> str:
        return format_table(self)

    def to_json(self) -> str:
        """The plan as JSON, to store and reuse with :meth:`from_json`."""
        blocks = [
            {
                "name": b.name,
                "class": b.kind,
                "choice": b.choice,
                "kept_bytes": b.kept_bytes,
                "recompute_cost": b.recompute_cost,
            }
            for b in self.blocks
        ]
        head = {"scopedckpt_plan": _FORMAT, "torch": torch.__version__}
        stored = {name: getattr(self, name) for name in _STORED}
        return json.dumps(
            {**head, **stored, "unused": list(self.unused), "blocks": blocks}, indent=1
        )

    def bind(self, model: nn.Module) -> Plan:
        """The same plan for another model with the same blocks (a copy of the model, a
        fresh instance of its class): blocks are found by their qualified names."""
        return Plan.from_json(self.to_json(), model)

    @classmethod
    def from_json(cls, text: str, model: nn.Module) -> Plan:
        """A plan stored by :meth:`to_json`, bound to ``model``, whose blocks must still
        be there, with the same classes."""
        data = json.loads(text)
        if not isinstance(data, Mapping) or data.get("scopedckpt_plan") != _FORMAT:
            raise ScopedCkptError(
                "scopedckpt: Plan.from_json() was given no plan of this scopedckpt version "
                f"(format {_FORMAT}); make the plan again with scopedckpt.plan()."
            )
        blocks = []
        for entry in data["blocks"]:
            name, kind = entry["name"], entry["class"]
            try:
                module = model.get_submodule(name)
            except AttributeError:
                module = None
            if module is None or type(module).__name__ != kind:
                found = "nothing" if module is None else article(type(module).__name__)
                raise ScopedCkptError(
                    f"scopedckpt: the plan's block {name!r} is {article(kind)}, but the model has "
                    f"{found} there: the plan was made for another model. Make it again "
                    "with scopedckpt.plan() on this one."
                )
            if entry["choice"] not in ("none", "full", *PRESETS):
                raise ScopedCkptError(
                    f"scopedckpt: the plan's block {name!r} has an unknown choice "
                    f"{entry['choice']!r}."
                )
            kept, cost = int(entry["kept_bytes"]), int(entry["recompute_cost"])
            blocks.append(PlannedBlock(name, kind, entry["choice"], kept, cost, module))
        stored = {name: read(data[name]) for name, read in _STORED.items()}
        return cls(tuple(blocks), **stored, unused=tuple(data.get("unused", ())), model=model)


def plan(
    model: nn.Module,
    *example_inputs: Any,
    budget: int | float | str,
    blocks: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
) -> Plan:
    """Plan the fastest checkpointing of ``model`` whose step fits ``budget``.

    Runs two training steps on the example inputs, counting every tensor's bytes
    and every op's cost, and leaves no trace: parameters, gradients, buffers and
    random streams are bit for bit as before. Then it chooses, per block, no
    region, a full region or a region with a ``save=`` preset, minimizing the
    predicted added cost with the predicted peak within the budget (optimal for
    the peak model: NOTE [ planning as a dynamic program ]). The choice follows
    counted costs, never timings (NOTE [ counted costs ]): the same model,
    inputs and budget give the same plan in every run.

    Parameters
    ----------
    model
        The model, in the mode it trains in (``model.train()``).
    *example_inputs
        Positional inputs of one step, at the shapes training uses.
    budget
        The step's peak memory above the model's resting state: what
        ``torch.cuda.max_memory_allocated()`` shows minus what was allocated
        before the step (activations, gradients, temporaries). Bytes (int), a
        size (``"512MiB"``, ``"3GB"``) or a float in (0, 1]: that fraction of
        the peak without checkpointing.
    blocks
        The candidate regions: an ``nn.ModuleList`` or an ``nn.Sequential`` of
        them (its children are the blocks: ``blocks=model`` for a Sequential
        model), a module, a class (its instances in the model), or a list of
        those, where a Sequential is one block; default: the repeated blocks
        :func:`scopedckpt.planner._blocks.find_blocks` finds. Never the model
        itself.
    loss_fn
        From the model's output to the loss; default: its ``loss`` attribute,
        else the sum of its first floating tensor.
    example_kwargs
        Keyword inputs of the step (Hugging Face's ``labels=``...): a mapping.

    Returns
    -------
    Plan

    Raises
    ------
    TypeError, ValueError
        Before any step runs, for a model, budget, ``loss_fn`` or
        ``example_kwargs`` of the wrong kind.
    ScopedCkptError
        Before any step runs, for ``blocks=`` outside the model or the model
        itself; after profiling, if the budget is below the smallest peak any
        plan reaches (the message says that smallest budget), or the blocks
        run twice or nest.

    Example
    -------
    >>> import torch, scopedckpt
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(
    ...     torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)])
    >>> plan = scopedckpt.plan(model, torch.randn(32, 64), budget=1.0)
    >>> [b.choice for b in plan.blocks]      # the whole budget: no regions
    ['none', 'none', 'none', 'none']
    """
    _check_arguments(model, budget, loss_fn, example_kwargs)
    found = candidates(model, blocks)  # checks blocks= before any step runs
    kwargs = dict(example_kwargs or {})
    profile = profile_step(model, found, tuple(example_inputs), kwargs, loss_fn or default_loss)
    limit = parse_budget(budget, profile.peak)
    return choose(profile, limit, model)


def _check_arguments(model: Any, budget: Any, loss_fn: Any, example_kwargs: Any) -> None:
    """Refuse :func:`plan`'s plain bad arguments before it profiles anything."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"scopedckpt: plan() takes the model first, an nn.Module, and got "
            f"{type(model).__name__}. Pass plan(model, *example_inputs, budget=...)."
        )
    parse_budget(budget, 0)  # raises for a bad budget before any step runs
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"scopedckpt: plan(loss_fn=...) must be a function from the model's output to "
            f"the loss, or None, and got {type(loss_fn).__name__}. Pass e.g. "
            "loss_fn=lambda out: out.loss."
        )
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(
            f"scopedckpt: plan(example_kwargs=...) must be a mapping from keyword names to "
            f"the step's keyword inputs, or None, and got {type(example_kwargs).__name__}. "
            "Pass e.g. example_kwargs={'labels': labels}."
        )
    for key in example_kwargs or ():
        if not isinstance(key, str):
            raise TypeError(
                f"scopedckpt: plan(example_kwargs=...) has the key {key!r}, which is not a "
                "keyword name. Pass str keys, e.g. example_kwargs={'labels': labels}."
            )


def choose(profile: Profile, budget: int, model: nn.Module | None) -> Plan:
    """The plan for ``budget`` from a profile (:func:`plan` without the profiling)."""
    floors = profile.floors
    options = [block.choices for block in profile.blocks]
    smallest = solve(floors, options, float("inf"), minimize="peak", late=profile.late)
    assert smallest is not None  # no budget: "none" everywhere is feasible
    solution = solve(floors, options, budget, late=profile.late)
    if solution is None:
        raise ScopedCkptError(
            f"scopedckpt: no plan fits a budget of {format_bytes(budget)}: the smallest "
            f"peak any plan of these blocks reaches is {format_bytes(smallest.peak)} "
            f"(without checkpointing: {format_bytes(profile.peak)}). Pass "
            f"budget={smallest.peak} or more, smaller inputs, or finer blocks= (blocks "
            f"that each keep less).{_one_sequential_hint(profile)}"
        )
    chosen = [(b, b.choices[c]) for b, c in zip(profile.blocks, solution.choices)]
    planned = tuple(
        PlannedBlock(b.name, type(b.module).__name__, o.name, o.kept, o.cost, b.module)
        for b, o in chosen
    )
    result = Plan(
        planned,
        budget,
        solution.peak,
        profile.peak,
        smallest.peak,
        profile.step_cost,
        solution.cost,
        profile.step_seconds,
        profile.costs,
        solution.optimal and smallest.optimal,
        profile.unused,
        profile.seconds,
        model,
    )
    remember(result)  # for out-of-memory notes (``_peak.py``)
    return result


def _one_sequential_hint(profile: Profile) -> str:
    """Where the only block is an ``nn.Sequential`` (given in a list): how to plan over
    its children instead."""
    if len(profile.blocks) != 1 or not isinstance(profile.blocks[0].module, nn.Sequential):
        return ""
    name = profile.blocks[0].name
    named = all(part.isidentifier() for part in name.split("."))
    path = f"model.{name}" if named else f"model.get_submodule({name!r})"
    return (
        f" The only block is the nn.Sequential {name!r}: to make its children the blocks, "
        f"pass it directly, blocks={path}, not in a list."
    )


def format_table(plan: Plan) -> str:
    """The plan as a table per block, with totals, the predicted peak and step time."""
    header = ("block", "class", "choice", "kept", "recompute")

    def row(name: str, kind: str, choice: str, kept: int, cost: int) -> tuple[str, ...]:
        ms = cost * plan.seconds_per_cost * 1e3  # the cost as time (NOTE [ counted costs ])
        return (name, kind, choice, format_bytes(kept), f"{ms:.2f} ms")

    rows = [row(b.name, b.kind, b.choice, b.kept_bytes, b.recompute_cost) for b in plan.blocks]
    regions = sum(b.choice != "none" for b in plan.blocks)
    kept = sum(b.kept_bytes for b in plan.blocks)
    total = row("total", "", f"{regions} region{'s' * (regions != 1)}", kept, plan.added_cost)
    table = text_table(header, rows, total, left=3)
    table.append(
        f"budget {format_bytes(plan.budget)}; predicted peak {format_bytes(plan.peak)} "
        f"(no checkpointing: {format_bytes(plan.no_checkpoint_peak)}, smallest feasible: "
        f"{format_bytes(plan.smallest_budget)})"
    )
    table.append(
        f"predicted step time {plan.overhead:.2f}x the step without checkpointing, from "
        f"{plan.costs} costs ({plan.step_seconds * 1e3:.1f} ms as timed + "
        f"{plan.added_cost * plan.seconds_per_cost * 1e3:.1f} ms)"
        + ("" if plan.optimal else "; front thinned, near-optimal")
    )
    if plan.unused:
        table.append(f"not run on the example inputs (no region): {', '.join(plan.unused)}")
    return "\n".join(table)
