"""``scopedckpt.plan``: exact under any budget, leaves no trace, optimal for its model."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import example, given, note
from hypothesis import strategies as st
from torch import nn

import scopedckpt
from scopedckpt import ScopedCkptError
from scopedckpt.planner._blocks import find_blocks
from scopedckpt.planner._budget import parse_budget
from scopedckpt.planner._live import LiveBytes
from scopedckpt.planner._plan import Plan, PlannedBlock
from scopedckpt.planner._profile import Choice, default_loss, profile_step
from scopedckpt.planner._solve import peak_of, solve
from scopedckpt.testing import assert_checkpoint_equivalent

from .strategies import (
    Banked,
    BlockCase,
    BlockModel,
    InPlaceWeight,
    OwnGenerator,
    PythonCoin,
    Tally,
    WarmUp,
    block_cases,
)


def _budget_between(case_model: nn.Module, x: torch.Tensor, fraction: float) -> int:
    whole = scopedckpt.plan(case_model, x, budget=1.0, blocks=case_model.blocks)
    low, high = whole.smallest_budget, whole.no_checkpoint_peak
    return max(1, math.ceil(low + fraction * (high - low)))


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()]


def _assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@given(case=block_cases())
def test_training_under_any_plan_is_exact(case: BlockCase) -> None:
    """Any budget between the smallest feasible and the whole peak gives a plan that
    trains bit for bit as without checkpointing, and planning leaves no trace."""
    note(repr(case))
    model, x = case.model, case.x.requires_grad_()
    state, rng = _state(model), torch.get_rng_state()
    budget = _budget_between(model, x, case.budget)
    plan = scopedckpt.plan(model, x, budget=budget, blocks=model.blocks)
    _assert_same(_state(model), state)
    assert torch.equal(torch.get_rng_state(), rng)
    assert plan.peak <= budget
    note(str(plan))
    assert_checkpoint_equivalent(
        model,
        x,
        targets=(plan,),
        steps=case.steps,
        seed=case.seed,
        require_regions=any(b.choice != "none" for b in plan.blocks),
    )


class _Writes(nn.Module):
    """Writes everything plan() must put back: buffers, a parameter in place, an own
    generator, the global RNG, batch norm statistics, a plain attribute and a warm-up
    switch, Python's random."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4, max_norm=0.5)
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)),
                nn.Sequential(Banked(4), InPlaceWeight(4), OwnGenerator(7)),
                nn.Sequential(nn.Linear(4, 4), scopedckpt.Dropout(0.3), nn.RReLU()),
                nn.Sequential(Tally(), WarmUp(), PythonCoin()),
            ]
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens).sum(1)
        for block in self.blocks:
            x = block(x)
        return x


def test_plan_leaves_no_trace() -> None:
    torch.manual_seed(0)
    model = _Writes()
    tokens = torch.randint(0, 10, (6, 3))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    grads = [p.grad for p in model.parameters()]
    generator = model.blocks[1][2].generator
    state, rng, own = _state(model), torch.get_rng_state(), generator.get_state()
    python = random.getstate()
    untouched = [*model.blocks[0].parameters(), *model.blocks[2].parameters()]
    versions = [p._version for p in untouched]
    plan = scopedckpt.plan(model, tokens, budget=1.0)
    _assert_same(_state(model), state)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(generator.get_state(), own)
    assert random.getstate() == python
    assert model.blocks[3][0].calls == 0 and model.blocks[3][1].calls == 0
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(g, torch.full_like(g, 0.5)) for g in grads)
    # Parameters nobody wrote are not even copied back.
    assert [p._version for p in untouched] == versions
    assert [b.choice for b in plan.blocks] == ["none"] * 4


def test_plan_puts_back_a_reassigned_buffer() -> None:
    class Reassigns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = self.seen + 1
            return x * 2

    model = BlockModel(nn.Identity(), [nn.Sequential(Reassigns()) for _ in range(2)], nn.Identity())
    original = model.blocks[0][0].seen
    scopedckpt.plan(model, torch.randn(3, 2, requires_grad=True), budget=1.0)
    assert model.blocks[0][0].seen is original
    assert torch.equal(original, torch.zeros(2))


def _stack(width: int = 32, depth: int = 6, batch: int = 64) -> tuple[BlockModel, torch.Tensor]:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(depth)
    ]
    return BlockModel(nn.Linear(8, width), blocks, nn.Linear(width, 1)), torch.randn(batch, 8)


def _measured_peak(model: nn.Module, x: torch.Tensor, plan: Plan, check: str = "bitwise") -> int:
    """The second step's peak (first-step transients aside), verified bit for bit as each
    site's first call and sampled ones are: the step the peak model predicts."""
    for _ in range(2):
        with LiveBytes() as counter:
            with scopedckpt.checkpointing(plan, determinism_check=check):
                loss = model(x).sum()
            loss.backward()
            del loss
        model.zero_grad(set_to_none=True)
    return counter.peak


def _full_regions(model: nn.Module, regions: list[nn.Module]) -> Plan:
    """A plan making each of ``regions`` a full region (its figures unused)."""
    return Plan(
        tuple(PlannedBlock(f"blocks.{i}", "", "full", 0, 0, b) for i, b in enumerate(regions)),
        budget=1, peak=1, no_checkpoint_peak=1, smallest_budget=1, step_cost=1, added_cost=0,
        step_seconds=1.0, costs="cpu", optimal=True, model=model,
    )  # fmt: skip


@pytest.mark.parametrize("fraction", [1.0, 0.75, 0.5, 0.0])
def test_predicted_peak_is_the_measured_peak(fraction: float) -> None:
    """NOTE [ peak model ]: at most the prediction and within 1 % of it, from the whole
    budget down to the smallest, so within the budget; activations, not gradients, make
    most of the peak here (batch 512), so what regions keep and rebuild shows."""
    model, x = _stack(batch=512)
    budget = _budget_between(model, x, fraction)
    plan = scopedckpt.plan(model, x, budget=budget)
    measured = _measured_peak(model, x, plan)
    assert measured <= plan.peak <= 1.01 * measured, (measured, plan.peak)
    assert plan.peak <= budget
    assert _measured_peak(model, x, plan, "default") <= measured  # unverified: no more


@pytest.mark.parametrize("fraction", [0.5, 0.0])
def test_predicted_peak_holds_where_recomputes_rebuild_more_than_backward_keeps(
    fraction: float,
) -> None:
    """Attention's forward holds score matrices its backward no longer needs: a recompute
    rebuilds them while the gradients are alive, which the second profiling step measures.
    Plans peak at most at their prediction, and within a block's output of it (NOTE
    [ inputs regions hold ]: a region's input is held, attention saves a copy of it)."""
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True) for _ in range(4)
    ]
    model = BlockModel(nn.Identity(), layers, nn.Linear(32, 1))
    x = torch.randn(8, 64, 32)
    budget = _budget_between(model, x, fraction)
    plan = scopedckpt.plan(model, x, budget=budget)
    measured = _measured_peak(model, x, plan)
    assert measured <= plan.peak <= measured + 8 * 64 * 32 * 4, (measured, plan.peak)


class _Masked(nn.Module):
    """A block that saves a copy of its input, not the input (as torch's attention saves a
    transposed copy), and adds a mask it is given by keyword without saving it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        h = self.linear(x.transpose(0, 1).clone(memory_format=torch.contiguous_format))
        return (h.transpose(0, 1) + mask) * 0.5


class _MaskedModel(nn.Module):
    """Makes its mask in its forward (outside every block), freed when the forward returns;
    with a wide head its peak is in the backward, without one in the last block's forward."""

    def __init__(self, head: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Masked() for _ in range(4))
        self.head = nn.Linear(32, 256) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(x).add_(x[:1, :1, :1])
        for block in self.blocks:
            x = block(x, mask=mask)
        return x if self.head is None else self.head(x).square()


def test_every_plan_keeps_its_promise_where_regions_hold_inputs_plain_training_frees() -> None:
    """NOTE [ inputs regions hold ]: a region keeps its inputs to its backward, where plain
    training freed the block output that only a transposed copy was saved of, and a mask
    made outside the blocks when the forward returned. Every plan of four blocks: the
    measured peak is at most the prediction and within 1 % of it (a region over the block
    after one without, or a mask held into the backward, peaked above it before)."""
    torch.manual_seed(0)
    model = _MaskedModel()
    x = torch.randn(512, 16, 32)
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    profile = profile_step(model, blocks, (x,), {}, default_loss)
    for chosen in itertools.product([0, 1], repeat=4):
        predicted = profile.predicted_peak(chosen)
        regions = [b for b, c in zip(model.blocks, chosen) if c]
        measured = _measured_peak(model, x, _full_regions(model, regions))
        assert measured <= predicted <= measured * 1.01, (chosen, measured, predicted)


def test_a_region_output_is_counted_once_while_the_next_block_runs() -> None:
    """NOTE [ inputs regions hold ]: while the block after a region runs, the region's output
    is that block's input, which the step without regions counts there: the prediction of
    every plan without a region on the last block (whose forward sets the peak) is the
    measured peak (it was a block's output above it on plans with a region before)."""
    torch.manual_seed(0)
    model = _MaskedModel(head=False)
    x = torch.randn(512, 16, 32)
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    profile = profile_step(model, blocks, (x,), {}, default_loss)
    for chosen in itertools.product([0, 1], repeat=3):
        regions = [b for b, c in zip(model.blocks, chosen) if c]
        measured = _measured_peak(model, x, _full_regions(model, regions))
        assert profile.predicted_peak((*chosen, 0)) == measured, chosen


class _Squashed(nn.Module):
    """A block whose forward, not its backward, sets the step's peak: it saves its output
    (tanh) and a linear layer's input, and its backward makes little."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).tanh()


def test_a_verified_region_forward_keeps_the_promise_of_every_plan() -> None:
    """NOTE [ inputs regions hold ]: a region's own peak is its recompute's or its verified
    first forward's, where fingerprints are taken (each site's first call and sampled ones
    are verified): with blocks whose forwards set the peak, every plan of four peaks at
    most at its prediction (the last region's verified forward peaked above it before)."""
    torch.manual_seed(0)
    layers = [_Squashed() for _ in range(4)]
    model = BlockModel(nn.Identity(), layers, nn.Identity())
    x = torch.randn(512, 64, 32)
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(layers)]
    profile = profile_step(model, blocks, (x,), {}, default_loss)
    for chosen in itertools.product([0, 1], repeat=4):
        regions = [b for b, c in zip(layers, chosen) if c]
        measured = _measured_peak(model, x, _full_regions(model, regions))
        assert measured <= profile.predicted_peak(chosen), (chosen, measured)


class _Probed(nn.Module):
    """Scales its output by a statistic of a wide projection taken without grad: a large
    forward temporary that backward never needs, but a recompute rebuilds."""

    def __init__(self) -> None:
        super().__init__()
        self.probe, self.linear = nn.Linear(32, 2048), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.probe(x).abs().amax()
        return self.linear(x).tanh() * scale


def test_the_peak_model_is_exact_with_every_block_a_region() -> None:
    """NOTE [ peak model ]: what the second profiling step measured, predicted back, where
    a recompute's temporaries outgrow what the block's backward needs."""
    torch.manual_seed(0)
    layers = [_Probed() for _ in range(4)]
    model = BlockModel(nn.Identity(), layers, nn.Linear(32, 1))
    x = torch.randn(256, 32)
    blocks = [(f"blocks.{i}", layer) for i, layer in enumerate(layers)]
    profile = profile_step(model, blocks, (x,), {}, default_loss)
    options = [block.choices for block in profile.blocks]
    full = [next(i for i, c in enumerate(o) if c.name == "full") for o in options]
    plan = _full_regions(model, [layer for _, layer in blocks])
    assert profile.predicted_peak(full) == _measured_peak(model, x, plan)


def test_whole_budget_is_no_regions_and_a_small_one_raises_with_the_smallest() -> None:
    model, x = _stack()
    whole = scopedckpt.plan(model, x, budget=1.0)
    assert [b.choice for b in whole.blocks] == ["none"] * 6
    assert whole.peak == whole.no_checkpoint_peak
    assert whole.added_cost == 0
    smallest = whole.smallest_budget
    assert smallest < whole.no_checkpoint_peak
    tight = scopedckpt.plan(model, x, budget=smallest)
    assert tight.peak == smallest
    assert sum(b.choice != "none" for b in tight.blocks) >= 3
    with pytest.raises(
        ScopedCkptError, match=rf"smallest peak any plan .* Pass budget={smallest} "
    ):
        scopedckpt.plan(model, x, budget=smallest - 1)


def test_plan_chooses_save_presets_and_checkpointing_applies_them() -> None:
    """A block planned with a preset keeps its matmuls' outputs (the report's kept bytes)."""
    model, x = _stack(depth=2)
    plan = Plan(
        (
            PlannedBlock("blocks.0", "Sequential", "matmuls", 0, 0, model.blocks[0]),
            PlannedBlock("blocks.1", "Sequential", "full", 0, 0, model.blocks[1]),
        ),
        budget=1, peak=1, no_checkpoint_peak=1, smallest_budget=1, step_cost=1, added_cost=0,
        step_seconds=1.0, costs="cpu", optimal=True, model=model,
    )  # fmt: skip
    with scopedckpt.memory_report(root=model) as report:
        with scopedckpt.checkpointing(plan, save=scopedckpt.policies.save_matmuls):
            loss = model(x).sum()
        loss.backward()
    kept = {row["region"]: row["kept_bytes"] for row in report.rows}
    # Both keep their input and the RNG stash; the preset also keeps its two matmuls'
    # outputs, and the full region ignores the scope's save=.
    assert kept["blocks.0"] - kept["blocks.1"] == 64 * 128 * 4 + 64 * 32 * 4


def test_plans_round_trip_through_json_and_refuse_another_model() -> None:
    model, x = _stack()
    budget = _budget_between(model, x, 0.3)
    plan = scopedckpt.plan(model, x, budget=budget)
    again = Plan.from_json(plan.to_json(), model)
    assert [(b.name, b.choice, b.module) for b in again.blocks] == [
        (b.name, b.choice, b.module) for b in plan.blocks
    ]
    assert (again.peak, again.budget) == (plan.peak, plan.budget)
    other = BlockModel(nn.Identity(), [nn.Linear(2, 2) for _ in range(6)], nn.Identity())
    with pytest.raises(ScopedCkptError, match=r"block 'blocks.0' is a Sequential, but the model"):
        Plan.from_json(plan.to_json(), other)
    with pytest.raises(ScopedCkptError, match="was given no plan"):
        Plan.from_json('{"blocks": []}', model)


def test_the_table_names_every_block_and_the_totals() -> None:
    model, x = _stack()
    plan = scopedckpt.plan(model, x, budget=_budget_between(model, x, 0.0))
    text = str(plan)
    for block in plan.blocks:
        assert block.name in text
    assert "predicted peak" in text and "total" in text and "x the step" in text


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(1000, 1000), ("2KiB", 2048), ("3 GB", 3 * 10**9), ("1.5mib", 3 * 2**19), (0.25, 250)],
)
def test_budget_forms(budget: object, expected: int) -> None:
    assert parse_budget(budget, 1000) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        ("2 parsecs", ValueError, "is not a size"),
        (1.5, ValueError, r"fraction .* in \(0, 1\]"),
        (0, ValueError, "must be positive"),
        (True, TypeError, "got bool"),
        ([1], TypeError, "got list"),
    ],
)
def test_budget_errors(budget: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_budget(budget, 1000)  # type: ignore[arg-type]


def test_find_blocks_takes_the_most_frequent_block_class_across_containers() -> None:
    def block() -> nn.Module:
        return nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU())

    class Stages(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(2, 2, 1)
            self.layer1 = nn.Sequential(block(), block())
            self.layer2 = nn.Sequential(block(), block(), block())
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(2, 2), nn.Linear(2, 2))

    names = [name for name, _ in find_blocks(Stages())]
    assert names == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2"]
    with pytest.raises(ScopedCkptError, match=r"found no repeated blocks .* Pass blocks="):
        find_blocks(nn.Linear(2, 2))


def test_blocks_that_run_twice_or_nest_are_refused() -> None:
    shared = nn.Sequential(nn.Linear(4, 4))

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([shared, nn.Sequential(nn.Linear(4, 4))])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[1](shared(shared(x)))

    x = torch.randn(2, 4)
    with pytest.raises(ScopedCkptError, match=r"block 'blocks.0' ran twice in one step"):
        scopedckpt.plan(Twice(), x, budget=1.0)
    outer = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))
    model = nn.Sequential(outer)
    with pytest.raises(ScopedCkptError, match=r"block '0.0' runs inside block '0'"):
        scopedckpt.plan(model, x, budget=1.0, blocks=[outer, outer[0]])


def test_blocks_outside_the_model_are_refused() -> None:
    model, x = _stack()
    with pytest.raises(ScopedCkptError, match="not a submodule of the model"):
        scopedckpt.plan(model, x, budget=1.0, blocks=nn.Linear(2, 2))


# The solver against every plan of small problems.

_options = st.builds(
    lambda kept, cost, recompute: Choice("x", kept, cost, recompute),
    st.integers(0, 100),
    st.integers(0, 10),  # few values: plans tie often
    st.integers(0, 200),
)

Problem = tuple[list[int | None], list[list[Choice]], list[int | None] | None]


@st.composite
def _problems(draw: st.DrawFn) -> Problem:
    n = draw(st.integers(1, 5))
    options = [
        [
            Choice("none", draw(st.integers(0, 150)), 0, None),
            *draw(st.lists(_options, min_size=0, max_size=3)),
        ]
        for _ in range(n)
    ]
    floors = [draw(st.none() | st.integers(0, 100)) for _ in range(n + 1)]
    late = draw(
        st.none() | st.lists(st.none() | st.integers(0, 200), min_size=n + 1, max_size=n + 1)
    )
    return floors, options, late


def _rule(options: list[list[Choice]], plan: tuple[int, ...]) -> tuple[object, ...]:
    """NOTE [ planning as a dynamic program ]'s order of plans: cost, then fewer regions,
    then at the first block where two differ a region before none, then the earlier option."""
    cost = sum(options[i][c].cost for i, c in enumerate(plan))
    order = tuple(c if c else len(options[i]) for i, c in enumerate(plan))
    return cost, sum(c > 0 for c in plan), order


# A late floor rules out the one plan with a region: none fits.
_LATE = (
    [0, 0],
    [[Choice("none", 60, 0, None), Choice("full", 1, 1, 0)]],
    [None, 100],
)
# A region on the first block keeps less and costs less than none, but a late floor
# rules out every plan with a region: it must not prune the plan without one.
_NO_REGION_YET = (
    [0, 0, 0],
    [
        [Choice("none", 10, 1, None), Choice("full", 5, 0, 0)],
        [Choice("none", 0, 0, None)],
    ],
    [None, None, 1000],
)


@given(problem=_problems(), budget=st.integers(0, 800))
@example(problem=_LATE, budget=50)
@example(problem=_NO_REGION_YET, budget=50)
def test_the_solver_finds_the_first_plan_by_its_rule_within_the_budget(
    problem: Problem, budget: int
) -> None:
    """NOTE [ planning as a dynamic program ]: against every plan, ties included, with late
    floors (NOTE [ inputs regions hold ])."""
    floors, options, late = problem
    plans = list(itertools.product(*(range(len(o)) for o in options)))
    feasible = [p for p in plans if peak_of(floors, options, p, late) <= budget]
    solution = solve(floors, options, budget, late=late)
    if not feasible:
        assert solution is None
        return
    assert solution is not None and solution.optimal
    assert peak_of(floors, options, solution.choices, late) == solution.peak <= budget
    best = min(feasible, key=lambda p: _rule(options, p))
    assert solution.choices == best
    assert solution.cost == _rule(options, best)[0]
    lowest = solve(floors, options, float("inf"), minimize="peak", late=late)
    assert lowest is not None
    assert lowest.peak == min(peak_of(floors, options, p, late) for p in plans)


def test_the_solver_thins_a_large_front_and_says_so() -> None:
    kinds = [Choice("none", 97, 0, None), Choice("full", 3, 10, 120), Choice("m", 41, 3, 100)]
    options = [kinds] * 60
    floors: list[int | None] = [0] * 61
    exact = solve(floors, options, 3000)
    thinned = solve(floors, options, 3000, cap=16)
    assert exact is not None and thinned is not None
    assert exact.optimal and not thinned.optimal
    assert thinned.peak <= 3000 and thinned.cost >= exact.cost


# The counter under the plans.


def test_live_bytes_count_new_storages_until_freed_and_not_views() -> None:
    weight = torch.randn(64, 64)
    with LiveBytes() as counter:
        transposed = weight.t()  # a view of a tensor made before: nothing new
        assert counter.live == 0
        y = weight.exp()
        y.add_(1)  # in place: nothing new
        view = y[:8]
        assert counter.live == 64 * 64 * 4
        del y
        assert counter.live == 64 * 64 * 4  # the view keeps the storage
        del view
        assert counter.live == 0
        grown = torch.empty(0)
        torch.exp(weight, out=grown)  # an out= op enlarges a counted storage
        assert counter.live == 64 * 64 * 4
        del grown
    assert counter.peak == 64 * 64 * 4
    del transposed


def _preset_plan(model: BlockModel) -> Plan:
    """blocks.0 with the matmuls preset, blocks.1 full, the rest none."""
    chosen = {0: "matmuls", 1: "full"}
    return Plan(
        tuple(
            PlannedBlock(f"blocks.{i}", "Sequential", chosen.get(i, "none"), 0, 0, block)
            for i, block in enumerate(model.blocks)
        ),
        budget=1, peak=1, no_checkpoint_peak=1, smallest_budget=1, step_cost=1, added_cost=0,
        step_seconds=1.0, costs="cpu", optimal=True, model=model,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's own internals warn
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_plan_around_a_compiled_model_keeps_its_presets_and_is_exact() -> None:
    """A plan's regions compile in the graph, each with its preset (NOTE [ torch.compile ]):
    one graph, no break, bitwise the compiled model without regions."""
    from torch._dynamo.utils import counters

    model, x = _stack(depth=3)
    plan = _preset_plan(model)

    def train(planned: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="aot_eager")
        with scopedckpt.checkpointing(plan, enabled=planned):
            loss = compiled(x).sum()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        assert counters["stats"]["unique_graphs"] == 1
        assert not sum(counters["graph_break"].values())
        return [loss.detach(), *grads]

    _assert_same(train(planned=True), train(planned=False))
    torch._dynamo.reset()


class _Basic(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, in-place ReLUs, and a
    strided 1x1 convolution on the shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu_()))
        return (h + self.down(x)).relu_()


def test_a_preset_block_never_peaks_above_its_prediction() -> None:
    """NOTE [ peak model ]: what a ``save=`` preset keeps lives on the region's tape through
    the block's whole backward, where a full region's recomputed tensors die as backward
    reads them, so a preset's recompute is taken as the full region's on top of what it
    keeps. Each block of a small ResNet made the one region, with each of its choices: the
    measured peak is at most the predicted one (the full region's recompute less the bytes
    the preset keeps put a ResNet-18 plan 0.8 % above its budget)."""
    torch.manual_seed(0)
    widths = [(32, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2)]
    blocks = [_Basic(*w) for w in widths]
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))
    model = BlockModel(nn.Conv2d(3, 32, 3, padding=1), blocks, head)
    x = torch.randn(4, 3, 16, 16)
    named = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    profile = profile_step(model, named, (x,), {}, lambda y: y.square().mean())
    options = [b.choices for b in profile.blocks]
    for i, block in enumerate(profile.blocks):
        for c, choice in enumerate(block.choices[1:], start=1):
            chosen = [c if j == i else 0 for j in range(len(options))]
            predicted = profile.predicted_peak(chosen)
            save = None if choice.name == "full" else scopedckpt.policies.save_convolutions

            def step(region: nn.Module, save: object) -> None:
                with scopedckpt.checkpointing(region, save=save):
                    loss = model(x).square().mean()
                loss.backward()

            step(model.blocks[i], save)  # the site's first call, verified: within it too
            measured = scopedckpt.measure_peak(step, model.blocks[i], save)
            assert measured <= predicted, (i, choice.name, measured - predicted)
            for p in model.parameters():
                p.grad = None
