"""``scopedckpt.plan``'s promise as users check it: ``measure_peak`` of a step under a plan
is within its budget; bad arguments are refused before any step runs; ``blocks=`` as
users mean it."""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt import ScopedCkptError

from .strategies import BlockModel


def _stack(
    depth: int = 6, batch: int = 256, dropout: float = 0.1
) -> tuple[BlockModel, torch.Tensor]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(dropout), nn.Linear(128, 32))
        for _ in range(depth)
    ]
    return BlockModel(nn.Linear(8, 32), blocks, nn.Linear(32, 1)), torch.randn(batch, 8)


def _step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(x).sum().backward()

    return step


# 1. measure_peak


def _planned(budget: float | str) -> tuple[BlockModel, torch.Tensor, scopedckpt.Plan]:
    model, x = _stack()
    if budget == "smallest":
        budget = scopedckpt.plan(model, x, budget=1.0).smallest_budget
    plan = scopedckpt.plan(model, x, budget=budget)
    assert any(b.choice != "none" for b in plan.blocks)
    return model, x, plan


@pytest.mark.parametrize(
    "budget",
    [
        0.5,
        "smallest",
    ],
)
def test_measured_peak_under_a_plan_is_within_its_budget_from_the_first_step(
    budget: float | str,
) -> None:
    """The three-line check of docs/memory-budget.md, over three steps from the first
    after planning, under the default sampled verification."""
    model, x, plan = _planned(budget)
    peaks = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with scopedckpt.checkpointing(plan):
            peaks.append(scopedckpt.measure_peak(_step(model, x)))
    assert all(peak <= plan.budget for peak in peaks), (peaks, plan.budget, str(plan))


def test_the_first_step_after_planning_is_verified() -> None:
    """Planning's profiling steps run under _sampling.suspended(), which counts no call:
    the user's first step is each site's first call, verified bit for bit."""
    model, x, plan = _planned(0.5)
    with scopedckpt.memory_report(root=model) as report:
        with scopedckpt.checkpointing(plan):
            _step(model, x)()
    assert all(row["verified"] > 0 for row in report.rows), str(report)


def test_a_verified_step_under_a_plan_is_within_its_budget() -> None:
    """What sampled verification's first call of each site does, every step here. At the
    smallest budget the plan is the one of least peak, whatever the timings."""
    model, x, plan = _planned("smallest")
    with scopedckpt.checkpointing(plan, determinism_check="bitwise"):
        peak = scopedckpt.measure_peak(_step(model, x))
    assert peak <= plan.budget, (peak, plan.budget)


def test_a_verified_region_with_a_preset_frees_what_it_keeps_with_its_backward() -> None:
    """NOTE [ no cycle through the tape ]: a verified region's kept op outputs (a save=
    preset's, 128 KiB a block here) go with its backward, not when the garbage collector
    runs; what verification adds is its fingerprints (8 KiB here, a block's output 32 KiB;
    with the cycle, 37 KiB), with the collector off. The first verified step, which makes
    the fingerprints' caches, goes first."""
    model, x = _stack()
    blocks = list(model.blocks)[:5]
    peaks = {}
    gc.disable()
    try:
        for check in ("bitwise", "bitwise", "none"):
            model.zero_grad(set_to_none=True)
            with scopedckpt.checkpointing(
                *blocks, save=scopedckpt.policies.save_matmuls, determinism_check=check
            ):
                peaks[check] = scopedckpt.measure_peak(_step(model, x))
    finally:
        gc.enable()
    assert 0 < peaks["bitwise"] - peaks["none"] < 16 * 1024, peaks


def test_measured_peak_without_regions_is_the_plans_exactly() -> None:
    """NOTE [ live bytes ], [ peak model ]: the planner's unit, and its peak without regions
    is exact: with no plan, and under a plan that chose no region."""
    model, x = _stack()
    plan = scopedckpt.plan(model, x, budget=1.0)
    assert [b.choice for b in plan.blocks] == ["none"] * 6
    assert scopedckpt.measure_peak(_step(model, x)) == plan.no_checkpoint_peak
    model.zero_grad(set_to_none=True)
    with scopedckpt.checkpointing(plan):
        assert scopedckpt.measure_peak(_step(model, x)) == plan.peak == plan.no_checkpoint_peak


def test_measure_peak_counts_the_backward_and_passes_arguments() -> None:
    model, x = _stack()

    def forward_only(inputs: torch.Tensor, *, scale: float) -> torch.Tensor:
        return (model(inputs) * scale).sum()

    forward = scopedckpt.measure_peak(forward_only, x, scale=2.0)
    whole = scopedckpt.measure_peak(_step(model, x))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < forward < whole and whole >= grads
    with pytest.raises(TypeError, match=r"measure_peak\(\) takes the step to run, a callable"):
        scopedckpt.measure_peak(model(x))


def test_measure_peak_only_observes() -> None:
    """A step measured trains bit for bit as the same step unmeasured: under a plan, with
    dropout drawing from the global stream."""
    model, x = _stack()
    plan = scopedckpt.plan(model, x, budget=0.5)

    def train(measured: bool) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        with scopedckpt.checkpointing(plan):
            if measured:
                scopedckpt.measure_peak(_step(model, x))
            else:
                _step(model, x)()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    unmeasured, measured = train(False), train(True)
    assert len(measured) == len(unmeasured) == len(list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(measured, unmeasured))


# 2. Bad arguments are refused before any step runs.


class _NoForward(nn.Module):
    """Blocks to plan for, and a forward that fails the test if anything profiles it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("plan() ran a forward before checking its arguments")


_REFUSED: list[tuple[dict[str, Any], type, str]] = [
    ({"budget": "lots"}, ValueError, r"plan\(budget='lots'\) is not a size"),
    ({"budget": "0MiB"}, ValueError, "must be positive bytes"),
    ({"budget": 0}, ValueError, "must be positive bytes"),
    ({"budget": 1.5}, ValueError, r"fraction .* in \(0, 1\]"),
    ({"budget": float("nan")}, ValueError, r"fraction .* in \(0, 1\]"),
    ({"budget": True}, TypeError, "got bool"),
    ({"budget": [1]}, TypeError, "got list"),
    ({"blocks": nn.Linear(4, 4)}, ScopedCkptError, "not a submodule of the model"),
    ({"blocks": []}, ScopedCkptError, "selects no module of the model"),
    ({"blocks": "layers"}, TypeError, "target #0 is a str"),
    ({"blocks": _NoForward}, ScopedCkptError, r"makes the whole model \(_NoForward\)"),
    ({"loss_fn": "sum"}, TypeError, r"plan\(loss_fn=...\) must be a function"),
    ({"example_kwargs": [("y", 1)]}, TypeError, r"must be a mapping .* got list"),
    ({"example_kwargs": {1: 2}}, TypeError, "has the key 1, which is not a keyword"),
]


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    _REFUSED,
    ids=[",".join(f"{k}={v!r}"[:32] for k, v in case[0].items()) for case in _REFUSED],
)
def test_bad_arguments_are_refused_before_any_step(
    arguments: dict[str, Any], error: type, match: str
) -> None:
    model = _NoForward()
    arguments = {"budget": 1.0, **arguments}
    with pytest.raises(error, match=match):
        scopedckpt.plan(model, torch.randn(2, 4), **arguments)


def test_good_arguments_reach_the_forward() -> None:
    """The model above does fail where plan() runs a step: the refusals are early."""
    with pytest.raises(AssertionError, match="ran a forward"):
        scopedckpt.plan(
            _NoForward(), torch.randn(2, 4), budget="1MiB", loss_fn=torch.sum, example_kwargs={}
        )
    with pytest.raises(TypeError, match=r"takes the model first, an nn\.Module"):
        scopedckpt.plan(torch.randn(2, 4), budget=1.0)  # type: ignore[arg-type]


# 3. blocks= as users mean it.


def _sequential() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    body = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)]
    )
    return nn.Sequential(nn.Linear(8, 32), body, nn.Linear(32, 1)), torch.randn(256, 8)


def test_a_sequential_passed_as_blocks_stands_for_its_children() -> None:
    model, x = _sequential()
    whole = scopedckpt.plan(model, x, budget=1.0, blocks=model)
    assert [b.name for b in whole.blocks] == ["0", "1", "2"]
    body = model[1]
    assert isinstance(body, nn.Sequential)
    plan = scopedckpt.plan(model, x, budget=0.5, blocks=body)
    assert [b.name for b in plan.blocks] == ["1.0", "1.1", "1.2", "1.3"]
    assert all(b.module is layer for b, layer in zip(plan.blocks, body))
    assert any(b.choice != "none" for b in plan.blocks)
    with scopedckpt.checkpointing(plan):
        assert scopedckpt.measure_peak(_step(model, x)) <= plan.budget


def test_a_sequential_in_a_list_is_one_block_and_errors_say_which_form() -> None:
    model, x = _sequential()
    one = scopedckpt.plan(model, x, budget=1.0, blocks=[model[1]])
    assert [b.name for b in one.blocks] == ["1"]
    with pytest.raises(
        ScopedCkptError,
        match=r"only block is the nn.Sequential '1'.* blocks=model.get_submodule\('1'\), not in",
    ):
        scopedckpt.plan(model, x, budget=0.5, blocks=[model[1]])
    with pytest.raises(ScopedCkptError, match=r"Pass blocks=model itself, not in a list"):
        scopedckpt.plan(model, x, budget=1.0, blocks=[model])


def test_the_whole_model_as_a_block_is_refused_with_its_blocks_named() -> None:
    model, x = _stack()
    with pytest.raises(
        ScopedCkptError,
        match=r"whole model \(BlockModel\) a block.*leave blocks= out \(plan\(\) then takes "
        r"blocks.0, blocks.1, blocks.2, \.\.\.\)",
    ):
        scopedckpt.plan(model, x, budget=0.5, blocks=model)


# The docs' check runs as written.


class _Output(nn.Module):
    """Blocks, and an output with a ``loss`` as Hugging Face models give one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> SimpleNamespace:
        for layer in self.layers:
            x = layer(x)
        return SimpleNamespace(loss=x.square().mean())


def test_the_three_line_check_in_the_docs_runs_as_written() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "memory-budget.md").read_text()
    section = text.split("## Checking a plan", 1)[1]
    code = re.search(r"```python\n(.+?)```", section, flags=re.S)
    assert code is not None and "scopedckpt.measure_peak(" in code.group(1)
    namespace: dict[str, Any] = {
        "scopedckpt": scopedckpt,
        "model": _Output(),
        "x": torch.randn(32, 16),
    }
    exec(compile(code.group(1), "docs/memory-budget.md", "exec"), namespace)
    assert 0 < namespace["peak"] <= namespace["plan"].budget
