"""A plan is a promise: counted costs, never timings, choose it (NOTE [ counted costs ]),
so the same model, inputs and budget give the same plan in every run and process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt.planner import _profile
from scopedckpt.planner._costs import CONSTANTS, op_cost
from scopedckpt.planner._plan import Plan
from scopedckpt.planner._solve import Choice, solve

_PLANS = textwrap.dedent(
    """
    import json, torch
    from torch import nn
    import scopedckpt

    def stack(layer, depth, stem, head):
        class Stack(nn.Module):
            def __init__(self):
                super().__init__()
                self.stem, self.head = stem, head
                self.blocks = nn.ModuleList(layer() for _ in range(depth))

            def forward(self, x):
                x = self.stem(x)
                for block in self.blocks:
                    x = block(x)
                return self.head(x)

        return Stack()

    torch.manual_seed(0)
    mlp = stack(lambda: nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)),
                6, nn.Linear(8, 32), nn.Linear(32, 1))
    attention = stack(lambda: nn.TransformerEncoderLayer(32, 2, 64, batch_first=True),
                      4, nn.Identity(), nn.Linear(32, 1))
    plans = []
    for model, x in ((mlp, torch.randn(256, 8)), (attention, torch.randn(4, 32, 32))):
        for budget in (0.4, 0.6):
            plan = scopedckpt.plan(model, x, budget=budget)
            plans.append([[b.name, b.choice, b.kept_bytes, b.recompute_cost]
                          for b in plan.blocks] + [plan.peak, plan.step_cost, plan.costs])
    print(json.dumps(plans))
    """
)


def _plans_in_a_new_process() -> list[object]:
    done = subprocess.run(
        [sys.executable, "-c", _PLANS], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_processes_make_the_same_plans() -> None:
    """Equal blocks, where timed recomputes used to pick which of them a region takes."""
    first, second = _plans_in_a_new_process(), _plans_in_a_new_process()
    assert first == second
    chosen = [[block[1] for block in plan[:-3]] for plan in first]  # type: ignore[index]
    assert any(c.count("none") not in (0, len(c)) for c in chosen), chosen  # real choices


@pytest.fixture
def noisy_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The planner's clock runs at a random pace: only the reported times may change."""
    generator = torch.Generator().manual_seed(1)
    now = [0.0]

    def perf_counter() -> float:
        now[0] += float(torch.rand((), generator=generator)) * 0.1
        return now[0]

    monkeypatch.setattr(_profile, "time", SimpleNamespace(perf_counter=perf_counter))
    yield


def _stack(depth: int = 6) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32))
        for _ in range(depth)
    ]
    model = nn.Sequential(nn.Linear(8, 32), nn.Sequential(*layers), nn.Linear(32, 1))
    return model, torch.randn(256, 8)


def _choices(plan: Plan) -> list[tuple[str, str, int]]:
    return [(b.name, b.choice, b.recompute_cost) for b in plan.blocks]


def test_timings_decide_nothing(noisy_clock: None) -> None:
    model, x = _stack()
    body = model[1]
    plans = [scopedckpt.plan(model, x, budget=0.5, blocks=body) for _ in range(3)]
    assert _choices(plans[0]) == _choices(plans[1]) == _choices(plans[2])
    assert len({p.step_seconds for p in plans}) == 3  # the clock did vary
    assert len({p.overhead for p in plans}) == 1  # the predicted ratio is the costs'


def test_equal_blocks_cost_the_same_and_a_region_costs_its_forward() -> None:
    """NOTE [ counted costs ]: integers, so equal blocks tie exactly, and the rule of NOTE
    [ planning as a dynamic program ] leaves the last of them alone."""
    model, x = _stack()
    plan = scopedckpt.plan(model, x, budget=0.6, blocks=model[1])
    costs = {b.recompute_cost for b in plan.blocks if b.choice == "full"}
    assert len(costs) == 1 and costs.pop() > CONSTANTS["cpu"].region
    chosen = [b.choice != "none" for b in plan.blocks]
    assert 0 < sum(chosen) < len(chosen)
    # Regions first, blocks left alone last, where the peak allows (the last block's
    # recompute buys nothing: NOTE [ peak model ]).
    assert chosen == sorted(chosen, reverse=True), str(plan)
    assert plan.added_cost == sum(b.recompute_cost for b in plan.blocks)


def test_an_op_costs_its_flops_and_bytes() -> None:
    machine = CONSTANTS["cpu"]
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    out = a @ b
    op, work = op_cost(machine, torch.ops.aten.mm.default, (a, b), {}, out)
    moved = (64 * 128 + 128 * 32 + 64 * 32) * 4
    assert op == machine.op
    assert work == 2 * 64 * 128 * 32 // machine.flops + moved // machine.bytes
    _, relu = op_cost(machine, torch.ops.aten.relu.default, (out,), {}, out.relu())
    assert relu == 2 * 64 * 32 * 4 // machine.bytes  # no flop formula: bytes only


def test_a_preset_pays_for_the_memory_it_keeps_beyond_a_full_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [ counted costs ]: on CPU a preset's cost adds KEPT per MiB of the outputs it keeps
    beyond a full region's (fresh memory held through the forward); a full region's does not."""
    model, x = _stack(depth=3)
    blocks = [(f"1.{i}", block) for i, block in enumerate(model[1])]

    def choices() -> dict[str, _profile.Choice]:
        profile = _profile.profile_step(model, blocks, (x,), {}, lambda y: y.sum())
        return {c.name: c for c in profile.blocks[0].choices}

    counted = choices()
    machine = CONSTANTS["cpu"]
    monkeypatch.setitem(CONSTANTS, "cpu", machine.__class__(**{**vars(machine), "kept": 0}))
    without = choices()
    extra = counted["matmuls"].kept - counted["full"].kept
    assert extra == 256 * 128 * 4  # the first linear's output (the second's is the block's)
    assert counted["matmuls"].cost - without["matmuls"].cost == extra * machine.kept >> 20
    assert counted["full"].cost == without["full"].cost


def test_plans_store_their_costs_and_reload_them() -> None:
    model, x = _stack()
    plan = scopedckpt.plan(model, x, budget=0.5, blocks=model[1])
    again = Plan.from_json(plan.to_json(), model)
    assert _choices(again) == _choices(plan)
    assert (again.step_cost, again.added_cost, again.costs) == (
        plan.step_cost,
        plan.added_cost,
        "cpu",
    )
    assert again.overhead == plan.overhead > 1.0


def _chosen(floors: list[int | None], options: list[list[Choice]], budget: int) -> tuple[int, ...]:
    solution = solve(floors, options, budget=budget)
    assert solution is not None
    return solution.choices


def test_ties_go_to_fewer_regions_then_to_regions_on_earlier_blocks() -> None:
    """Equal blocks cost exactly the same: which of them is left alone is the rule's
    (NOTE [ planning as a dynamic program ]), whatever the order states arise in."""
    none, full, preset = Choice("none", 10, 0, None), Choice("full", 5, 4, 0), Choice("m", 5, 4, 0)
    floors: list[int | None] = [0] * 5
    # Two regions of four needed, any two fit: the first two blocks take them.
    assert _chosen(floors, [[none, full]] * 4, budget=30) == (1, 1, 0, 0)
    # One needed: the first block, with the earlier of two equal options (the profile
    # lists full first).
    assert _chosen(floors, [[none, full, preset]] * 4, budget=35) == (1, 0, 0, 0)
    assert _chosen(floors, [[none, preset, full]] * 4, budget=35) == (1, 0, 0, 0)
    # One region of cost 8 before two of cost 4 each, wherever it is.
    double = Choice("full", 0, 8, 0)
    assert _chosen(floors[:4], [[none, full]] * 2 + [[none, double]], budget=20) == (0, 0, 1)
    assert _chosen(floors[:4], [[none, double]] + [[none, full]] * 2, budget=20) == (1, 0, 0)
