"""``determinism_check="bitwise"``: recomputes proven equal to the first forward, bit for bit,
from fingerprints (``_verify.py``, NOTE [ bitwise verification ]; issue 25)."""

from __future__ import annotations

import inspect
import math
import re
import weakref

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import given, note
from hypothesis import strategies as st
from torch import nn

import scopedckpt
from scopedckpt.core import _targets
from scopedckpt.integrations import patch_torch_checkpoint
from scopedckpt.mechanisms import _verify
from scopedckpt.testing import assert_checkpoint_equivalent

from .strategies import Case, ProgramModel, Region, cases


class _Tally:
    """A plain object (not a module): the forward's world records module attributes
    shallowly, so what this object holds is not replayed."""

    def __init__(self) -> None:
        self.calls = 0


class Counting(nn.Module):
    """Python state outside the modules' attributes, changed in forward, that feeds the
    computation: nothing can replay it (NOTE [ forward's world ] leaves it out)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.tally = _Tally()

    @property
    def calls(self) -> int:
        return self.tally.calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tally.calls += 1
        return torch.tanh(self.linear(x) * self.tally.calls)


def _moved_in_recomputes(y: torch.Tensor, index: int) -> torch.Tensor:
    """``y``, with the value at flat ``index`` (modulo its size) moved by one ulp in
    recomputes only: the same graph, one value moved."""
    if not scopedckpt.is_recomputing():
        return y
    flat = y.detach().reshape(-1).clone()
    i = index % flat.numel()
    flat[i] = torch.nextafter(flat[i], torch.tensor(float("inf")))
    return y + (flat.reshape(y.shape) - y).detach()


class Perturbed(nn.Module):
    """Changes one value of a tensor autograd saves by one ulp, only in recomputes."""

    def __init__(self, index: int, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.index = index
        self.weight = nn.Parameter(torch.randn(shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _moved_in_recomputes(x.sigmoid(), self.index) * self.weight  # saves it


def test_a_python_attribute_changed_in_forward_is_caught_and_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Counting(), nn.ReLU()), nn.Linear(4, 1))
    with scopedckpt.checkpointing(model[1], root=model, determinism_check="bitwise"):
        loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(scopedckpt.ScopedCkptError) as error:
        loss.backward()
    # The step is lost: its module targets are unpatched now, though `loss` keeps the graph.
    assert not _targets._PATCHES
    message = str(error.value)
    assert "bitwise verification failed" in message
    assert "'1' (Sequential)" in message  # the region
    assert "Tanh" in message  # the op whose saved output differs first
    assert re.search(r"test_verify\.py:\d+ \(in forward\)", message)  # the source line
    assert "Stateful" in message  # a fix


def test_default_check_is_silent_where_bitwise_is_not() -> None:
    """torch's own check compares shapes only: the same model trains silently wrong."""
    torch.manual_seed(0)
    model = nn.Sequential(Counting(), nn.ReLU())
    x = torch.randn(3, 4, requires_grad=True)
    torch_checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()  # no error
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(model, x, determinism_check="bitwise")
    with pytest.raises(scopedckpt.ScopedCkptError, match="bitwise verification failed"):
        out.sum().backward()


@given(st.integers(0, 10_000), st.sampled_from([(3, 5), (2, 3, 4), (17,)]))
def test_any_single_value_changed_by_one_ulp_is_caught(index: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    region = Perturbed(index, shape)
    x = torch.randn(*shape, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(region, x, determinism_check="bitwise")
    with pytest.raises(scopedckpt.ScopedCkptError, match="Saved tensor #") as error:
        out.sum().backward()
    numel = math.prod(shape)  # at most 64 values: counted exactly
    assert f"1 of its {numel} values differs" in str(error.value)
    assert f"the first at flat index {index % numel}." in str(error.value)


@pytest.mark.parametrize("index", [0, 101, 1269, 102])
def test_large_tensors_count_differences_in_a_sample_of_64_values(index: int) -> None:
    """A tensor of 1,270 values: 64 are kept, at rounded evenly spaced positions (0, 20,
    40, ..., 101 is the sixth); a value moved elsewhere is seen by the sums only."""
    torch.manual_seed(0)
    region = Perturbed(index, (127, 10))
    x = torch.randn(127, 10, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(region, x, determinism_check="bitwise")
    with pytest.raises(scopedckpt.ScopedCkptError, match="Saved tensor #") as error:
        out.sum().backward()
    message = str(error.value)
    if index == 102:  # not a sampled position
        assert "None of the 64 values sampled at evenly spaced positions differ" in message
    else:
        assert "1 of the 64 values sampled at evenly spaced positions differs" in message
        assert f"the first at flat index {index}." in message


def test_reordered_values_are_caught() -> None:
    """A recompute whose values are the forward's, rows swapped: the plain sum is blind."""

    class Swapped(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            return (y.flip(0) if scopedckpt.is_recomputing() else y).exp()

    x = torch.randn(4, 3, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(Swapped(), x, determinism_check="bitwise")
    with pytest.raises(scopedckpt.ScopedCkptError):
        out.sum().backward()


class OneValueMoved(nn.Module):
    """Moves one value of a saved tensor by one ulp, only in recomputes."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _moved_in_recomputes(x.sigmoid(), self.index)  # saves it


class TwoOpsReordered(nn.Module):
    """Runs two ops in the other order in recomputes: each saves its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if scopedckpt.is_recomputing():
            b = x.tanh()
            a = x.sigmoid()
        else:
            a = x.sigmoid()
            b = x.tanh()
        return x + a * b


def _lines(module: type[nn.Module]) -> range:
    lines, first = inspect.getsourcelines(module.forward)
    return range(first, first + len(lines))


@given(
    case=cases(max_steps=1),
    divergence=st.sampled_from([OneValueMoved, TwoOpsReordered]),
    index=st.integers(0, 10_000),
    where=st.integers(0, 10),
)
def test_any_single_injected_divergence_in_a_random_model_is_caught_and_named(
    case: Case, divergence: type[nn.Module], index: int, where: int
) -> None:
    """A random exact model (test_exactness's) with one divergence injected into its
    first region: one value moved by one ulp, or two ops run in the other order. The
    recompute's first differing saved tensor raises, naming the op's source line."""
    model = case.model
    layer = OneValueMoved(index) if divergence is OneValueMoved else TwoOpsReordered()
    model.pool.append(layer)
    first, *rest = model.program  # a region: cases() makes the program one if needed
    region = (
        first
        if isinstance(first, Region)
        else next(item for item in rest if isinstance(item, Region))
    )
    at = where % (len(region.body) + 1)
    injected = Region(
        (*region.body[:at], len(model.pool) - 1, *region.body[at:]), region.early_stop
    )
    model.program = tuple(injected if item is region else item for item in model.program)
    with pytest.raises(scopedckpt.ScopedCkptError, match="bitwise verification failed") as error:
        assert_checkpoint_equivalent(
            model, case.x, targets=(), seed=case.seed, determinism_check="bitwise"
        )
    line = re.search(r"test_verify\.py:(\d+) \(in forward\)", str(error.value))
    assert line is not None, str(error.value)
    assert int(line.group(1)) in _lines(divergence), str(error.value)
    assert re.search(r"\d+ of (its|the) \d+ values", str(error.value)), str(error.value)


@given(case=cases(), backward=st.sampled_from(["backward", "retain_graph"]))
def test_exact_models_pass_bitwise_verification(case: Case, backward: str) -> None:
    """Random models (test_exactness's, layers drawing from generators of their own
    included) are exact, so verification never raises on them."""
    note(repr(case))
    assert_checkpoint_equivalent(
        case.model,
        case.x,
        targets=(),
        steps=case.steps,
        seed=case.seed,
        backward=backward,
        determinism_check="bitwise",
    )


def test_an_exact_recompute_is_compared_on_every_saved_tensor() -> None:
    torch.manual_seed(0)
    block = scopedckpt.convert(
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3), nn.GELU())
    )
    x = torch.randn(5, 4, requires_grad=True)
    before = _verify.COUNTERS.compared
    with scopedckpt.checkpointing(determinism_check="bitwise"):
        out = scopedckpt.checkpoint(block, x)
    out.sum().backward()
    assert _verify.COUNTERS.compared - before >= 4  # linear, batch norm, dropout, gelu


def test_rrelu_layers_are_recomputed_whole_and_exact() -> None:
    """RReLU saves its noise before writing it: torch's early stop would end the
    recompute inside the op (issue 25, hole 1). A region over a module holding an
    nn.RReLU in training recomputes whole (NOTE [ late writes ]): exact, verified."""
    torch.manual_seed(0)
    region = nn.Sequential(nn.Linear(4, 4), nn.RReLU())
    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(1)
    region(x).sum().backward()
    expected, x.grad = x.grad, None
    torch.manual_seed(1)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(region, x, determinism_check="bitwise")
    out.sum().backward()
    assert torch.equal(x.grad, expected)
    with scopedckpt.checkpointing(region):  # as a module target
        out = region(x)
    out.sum().backward()


@pytest.mark.usefixtures("no_sampling")
def test_rrelu_layers_recompute_whole_without_any_verification() -> None:
    """The subtree listing finds nn.RReLU layers with no verified call to see them save
    (NOTE [ late writes ])."""
    torch.manual_seed(0)
    region = nn.Sequential(nn.Linear(4, 4), nn.RReLU(), nn.Linear(4, 4), nn.RReLU())
    x = torch.randn(8, 4, requires_grad=True)
    for step in range(3):
        torch.manual_seed(step)
        region(x).sum().backward()
        expected, x.grad = x.grad, None
        torch.manual_seed(step)
        with scopedckpt.checkpointing(region):
            out = region(x)
        out.sum().backward()
        assert torch.equal(x.grad, expected), f"step {step}"
        x.grad = None


def test_rrelu_in_eval_mode_saves_unwritten_noise_that_is_not_compared() -> None:
    """In eval mode rrelu saves its noise unwritten and never reads it: each run saves
    whatever memory it got (found by the thorough property test). NOTE [ unread saved
    tensors ]: compared by shape only, so verification passes, and the step is exact."""
    torch.manual_seed(0)
    region = nn.Sequential(nn.Linear(4, 4), nn.RReLU()).eval()
    x = torch.randn(3, 4, requires_grad=True)
    region(x).sum().backward()
    expected, x.grad = x.grad, None
    for _ in range(5):
        with scopedckpt.checkpointing():
            out = scopedckpt.checkpoint(region, x, determinism_check="bitwise")
        junk = torch.randn(3, 4)  # other values where the allocator may hand memory back
        out.sum().backward()
        assert torch.equal(x.grad, expected)
        x.grad = None
        del junk


class FunctionalRReLU(nn.Module):
    """F.rrelu in training outside an nn.RReLU layer: not seen by the subtree listing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rrelu(self.linear(x), training=True)


def _rrelu_function(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rrelu(t * 2, training=True)


@pytest.mark.parametrize("how", ["function", "module"])
def test_functional_rrelu_recomputes_whole_from_the_first_step(how: str) -> None:
    """F.rrelu saves its noise before writing it (NOTE [ late writes ]): the first call of
    a site, verified by default, sees it, recomputes that region whole and remembers the
    site, whose later (unverified) calls recompute whole too. Exact at every step."""
    torch.manual_seed(0)
    layer = FunctionalRReLU()
    fn = _rrelu_function if how == "function" else layer
    x = torch.randn(3, 4, requires_grad=True)
    before = _verify.COUNTERS.compared
    for step in range(4):
        torch.manual_seed(step)
        fn(x).sum().backward()
        expected = [x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]
        x.grad = None
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with scopedckpt.checkpointing():
            out = scopedckpt.checkpoint(fn, x)
        out.sum().backward()
        got = [x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"step {step}"
        x.grad = None
        layer.zero_grad(set_to_none=True)
    assert _verify.COUNTERS.compared > before  # the first call was verified
    from scopedckpt.core import _early_stop, _subtree

    module = layer if how == "module" else None
    listing = None if module is None else _subtree.subtree(module)
    assert _early_stop.full_recompute(listing, module, fn)


def test_functional_rrelu_is_exact_under_bitwise_and_without_early_stop() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    for early_stop in (True, False):
        with scopedckpt.checkpointing():
            out = scopedckpt.checkpoint(
                _rrelu_function, x, determinism_check="bitwise", early_stop=early_stop
            )
        out.sum().backward()


def test_every_recompute_is_verified_and_nested_regions_too() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(Counting(), nn.ReLU())
    outer = nn.Sequential(nn.Linear(4, 4), inner)
    x = torch.randn(3, 4, requires_grad=True)
    with scopedckpt.checkpointing(inner, outer, determinism_check="bitwise"):
        out = outer(x)
    with pytest.raises(scopedckpt.ScopedCkptError, match="bitwise verification failed"):
        out.sum().backward()


def test_the_patch_and_checkpoint_sequential_take_bitwise() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Counting(), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint_sequential(model, 2, x, determinism_check="bitwise")
    with pytest.raises(scopedckpt.ScopedCkptError):
        out.sum().backward()
    with patch_torch_checkpoint(), scopedckpt.checkpointing():
        out = torch_checkpoint.checkpoint(
            model, x, use_reentrant=False, determinism_check="bitwise"
        )
    with pytest.raises(scopedckpt.ScopedCkptError):
        out.sum().backward()


def test_fingerprints_of_equal_tensors_are_equal_and_of_others_not() -> None:
    x = torch.randn(5, 6)
    a, b = _verify.fingerprint(x), _verify.fingerprint(x.clone())
    assert a == b
    for other in (x.t().contiguous().t(), x + 0.0):
        assert _verify.fingerprint(other) == a
    y = x.clone()
    y[2, 3] = torch.nextafter(y[2, 3], torch.tensor(float("inf")))
    assert _verify.fingerprint(y) != a
    assert _verify.fingerprint(x.flip(0)) != a  # rows moved
    assert _verify.fingerprint(x.reshape(6, 5)) != a
    for t in (torch.ones(3, dtype=torch.bool), torch.randn(3, dtype=torch.complex64),
              torch.randn(2, 2).half(), torch.tensor(1.5)):  # fmt: skip
        assert _verify.fingerprint(t) == _verify.fingerprint(t.clone())


def test_bitwise_in_compiled_code_raises() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return scopedckpt.checkpoint(torch.sin, x, determinism_check="bitwise")

    torch._dynamo.reset()
    with scopedckpt.checkpointing():
        with pytest.raises(Exception, match="cannot apply in compiled code"):
            torch.compile(step, backend="eager")(torch.randn(3, requires_grad=True))


def test_memory_report_counts_the_verified_tensors() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    with scopedckpt.memory_report() as report:
        with scopedckpt.checkpointing():
            out = scopedckpt.checkpoint(block, x, determinism_check="bitwise")
        out.sum().backward()
    (row,) = report.rows
    assert row["recomputes"] == 1 and row["verified"] >= 2  # linear input, tanh output
    assert "verified" in str(report)


class NormalizedTwice(nn.Module):
    """One torch batch norm (not converted) called twice in a region."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(self.norm(x))).tanh()


def test_a_batch_norm_called_twice_in_a_region_passes_bitwise_verification() -> None:
    """Its first call saves its running statistics, which its second call updates in place
    before the first forward's fingerprints are taken (at its end): they are not compared
    (backward in training does not read them), so the exact model passes, over 3 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(NormalizedTwice(), nn.Linear(4, 1))
    assert_checkpoint_equivalent(
        model, torch.randn(8, 4), targets=[model[0]], steps=3, determinism_check="bitwise"
    )


def test_a_divergence_before_a_nested_call_of_a_batch_norm_is_named_where_it_happens() -> None:
    """A batch norm called before a value that moves in recomputes only, and after it in a
    nested region and again (found by the thorough profile of the property test above):
    the error names the op that diverged (a saved tensor of OneValueMoved), not the
    statistics the batch norm's first call saved and its later calls update in place."""
    norm = nn.BatchNorm1d(1, momentum=None, affine=False)
    nested = Region((Region((0,), False),), False)
    model = ProgramModel([norm, OneValueMoved(0)], (Region((0, 1, nested, 0), False),))
    x = torch.tensor([[1.5410], [-0.2934]])
    with pytest.raises(scopedckpt.ScopedCkptError, match="bitwise verification failed") as error:
        assert_checkpoint_equivalent(model, x, targets=(), seed=0, determinism_check="bitwise")
    line = re.search(r"test_verify\.py:(\d+) \(in forward\)", str(error.value))
    assert line is not None and int(line.group(1)) in _lines(OneValueMoved), str(error.value)


def test_a_verified_region_keeps_its_input_no_longer_than_its_backward() -> None:
    """A training loop's loss (and with it the graph) often lives until the next step's
    forward; a verified region's tape goes with its backward (NOTE [ no cycle through the
    tape ]), and its input with it."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    h = torch.randn(3, 4, requires_grad=True) * 2  # the region's input, made here
    input_ref = weakref.ref(h)
    with scopedckpt.checkpointing(block, determinism_check="bitwise"):
        loss = block(h).sum()
    del h
    loss.backward()
    assert input_ref() is None  # freed by backward, although `loss` is alive
    del loss
