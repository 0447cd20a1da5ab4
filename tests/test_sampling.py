"""Sampled verification: the default determinism check verifies the first call of each
region site and, after it, one call in 64 on average drawn without a period, bit for bit
(NOTE [ sampled verification ] in ``_sampling.py``)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt.core import _sampling
from scopedckpt.integrations import patch_torch_checkpoint
from scopedckpt.mechanisms import _verify

from .test_verify import Counting


class OwnGenerator(nn.Module):
    """Dropout with its own torch.Generator: not replayed by the default-generator stash
    but by NOTE [ explicit generators ] (issue 25, hole 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=self.generator) > 0.5
        return torch.tanh(self.linear(x)) * keep


@pytest.fixture
def every_64() -> Iterator[None]:
    previous = scopedckpt.set_verification_sampling(64)  # the default, counts started over
    yield
    scopedckpt.set_verification_sampling(previous)


def _step(model: nn.Module, x: torch.Tensor, **scope: object) -> None:
    with scopedckpt.checkpointing(model[1], root=model, **scope):  # type: ignore[arg-type]
        loss = model(x).sum()
    loss.backward()


@pytest.mark.usefixtures("every_64")
def test_a_region_that_cannot_be_recomputed_exactly_fails_on_the_first_step() -> None:
    """Python state outside the modules' attributes: nothing replays it, and by default
    the first step says so, naming the region, instead of training silently wrong."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Counting(), nn.Linear(4, 1))
    with pytest.raises(scopedckpt.ScopedCkptError, match="bitwise verification failed") as error:
        _step(model, torch.randn(3, 4))
    assert "'1'" in str(error.value)


@pytest.mark.usefixtures("every_64")
def test_a_private_generator_is_found_by_the_first_step_and_replayed() -> None:
    """A generator of the layer's own: the first (verified) call finds it (NOTE [ explicit
    generators ]), so the step is exact, and so are the unverified ones after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), OwnGenerator(), nn.Linear(4, 1))
    plain = copy.deepcopy(model)
    x = torch.randn(3, 4)
    for _ in range(3):
        plain(x).sum().backward()
        _step(model, x)
    assert all(
        torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
        for a, b in zip(model.parameters(), plain.parameters())
    )
    assert torch.equal(model[1].generator.get_state(), plain[1].generator.get_state())


@pytest.mark.usefixtures("every_64")
def test_the_first_call_and_a_drawn_one_in_64_of_a_site_are_verified() -> None:
    torch.manual_seed(0)
    model = scopedckpt.convert(
        nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2)))
    )
    x = torch.randn(3, 4)
    verified = []
    for _ in range(130):
        before = _verify.COUNTERS.compared
        _step(model, x)
        verified.append(_verify.COUNTERS.compared > before)
    drawn = [i for i in range(130) if _sampling.sampled(i, 64)]
    assert [i for i, v in enumerate(verified) if v] == drawn
    assert drawn[0] == 0 and 1 < len(drawn) < 8


def test_no_call_pattern_of_any_period_escapes_sampled_verification() -> None:
    """Every residue class of every period up to 128 has a verified call: a site whose
    calls alternate between kinds (an inner loop's and a functional_call's) has each kind
    verified, where "every 64th" verified calls 1, 65, 129, ... only."""
    for every in (2, 3, 64):
        verified = [n for n in range(80_000) if _sampling.sampled(n, every)]
        assert 0.9 / every < len(verified) / 80_000 < 1.1 / every
        for period in range(2, 129):
            assert {n % period for n in verified} == set(range(period)), (every, period)


@pytest.mark.usefixtures("every_64")
def test_function_regions_are_one_site_per_code_not_per_function_object() -> None:
    """A lambda is a new object at every call: its site is its code."""
    x = torch.randn(3, 4, requires_grad=True)
    verified = 0
    for _ in range(5):
        before = _verify.COUNTERS.compared
        with scopedckpt.checkpointing():
            out = scopedckpt.checkpoint(lambda t: t.sin() * 2, x)
        out.sum().backward()
        verified += _verify.COUNTERS.compared > before
    assert verified == 1


@pytest.mark.usefixtures("every_64")
def test_a_module_at_a_reused_id_is_a_new_site() -> None:
    first = nn.Linear(2, 2)
    assert _sampling.sampled_check("default", None, first)[0] == "bitwise"  # a module as fn
    assert _sampling.sampled_check("default", first, None)[0] == "default"  # the same site
    assert _sampling.sampled_check("default", first, None)[0] == "default"
    ident = id(first)
    del first
    for _ in range(100):  # the allocator hands the id out again, often at once
        second = nn.Linear(2, 2)
        if id(second) == ident:
            assert _sampling.sampled_check("default", second, None)[0] == "bitwise"
            return
    pytest.skip("the allocator did not reuse the id")


@pytest.mark.usefixtures("every_64")
def test_explicit_checks_debug_mode_and_sampling_off_are_not_sampled() -> None:
    """Each of these trains the not-exact model silently, as asked."""

    def model() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), Counting(), nn.Linear(4, 1))

    torch.manual_seed(0)
    _step(model(), torch.randn(3, 4), determinism_check="none")
    x = torch.randn(3, 4, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(model(), x, debug=True)  # torch's debug mode: its check
    out.sum().backward()
    scopedckpt.set_verification_sampling(0)
    _step(model(), torch.randn(3, 4))


@pytest.mark.usefixtures("every_64")
def test_torchs_checkpoint_under_the_patch_is_sampled_too() -> None:
    torch.manual_seed(0)
    layer = Counting()
    x = torch.randn(3, 4, requires_grad=True)
    with patch_torch_checkpoint():
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    with pytest.raises(scopedckpt.ScopedCkptError, match="bitwise verification failed"):
        out.sum().backward()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_the_sampling_period_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="int >= 0"):
        scopedckpt.set_verification_sampling(bad)  # type: ignore[arg-type]
