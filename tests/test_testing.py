"""scopedckpt.testing: the helpers users run in their own CI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt.testing import assert_checkpoint_equivalent, default_loss

DOCS = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def test_the_documented_example_runs_as_written() -> None:
    code = re.search(r"```python\n(.+?)```", DOCS.read_text(), flags=re.S)
    assert code is not None
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(code.group(1), str(DOCS), "exec"), namespace)
    namespace["test_checkpointing_is_exact"]()  # type: ignore[operator]
    namespace["test_no_unscoped_randomness"]()  # type: ignore[operator]


class RecomputeCounter(nn.Module):
    """A user layer counting recomputes in a Python attribute and scaling by the count:
    nothing restores Python attributes, so its backward differs."""

    def __init__(self) -> None:
        super().__init__()
        self.recomputes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if scopedckpt.is_recomputing():
            self.recomputes += 1
        # A tensor factor is saved for backward, so the recompute's factor is the one used.
        return x.tanh() * torch.full_like(x, 1.0 + self.recomputes)


def test_mismatch_names_the_first_differing_tensor() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), RecomputeCounter())
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "scopedckpt: step 0: gradient of parameter '0.weight' differs between the "
            "checkpointed and the plain run: max abs diff"
        ),
    ):
        assert_checkpoint_equivalent(model, torch.randn(5, 4))


class PrivateNoise(nn.Module):
    """Unscoped randomness from its own generator, made at its first forward and kept in a
    list: no region holds it when it starts, and the testing helper verifies nothing
    unless asked, so no watch finds it (NOTE [ explicit generators ]): nothing replays
    it. ``reachable``: the list holds it from the start."""

    def __init__(self, reachable: bool = False) -> None:
        super().__init__()
        self.streams = [torch.Generator().manual_seed(0)] if reachable else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.streams:
            self.streams.append(torch.Generator().manual_seed(0))
        noise = torch.nn.init.uniform_(torch.empty(x.shape), 0.0, 1.0, self.streams[0])
        return x * (noise < 0.5)


def test_unscoped_randomness_from_a_private_generator_is_caught() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), PrivateNoise())
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "scopedckpt: step 0: gradient of parameter '0.weight' differs between the "
            "checkpointed and the plain run: max abs diff "
        ),
    ):
        assert_checkpoint_equivalent(model, torch.randn(5, 4), targets=[model])


def test_a_private_generator_the_region_reaches_is_replayed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), PrivateNoise(reachable=True))
    assert_checkpoint_equivalent(model, torch.randn(5, 4), targets=[model])


def test_a_run_without_regions_fails() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(AssertionError, match="made no checkpoint region"):
        assert_checkpoint_equivalent(model, torch.randn(2, 4), targets=())


def test_model_and_callers_rng_are_left_alone() -> None:
    model = scopedckpt.convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)
    rng = torch.get_rng_state()
    assert_checkpoint_equivalent(model, x, steps=2, backward="retain_graph")
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_bad_arguments_are_rejected() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=re.escape("scopedckpt: steps must be a positive int, got 0.")
    ):
        assert_checkpoint_equivalent(model, torch.ones(2, 2), steps=0)
    with pytest.raises(ValueError, match=re.escape("scopedckpt: backward must be one of")):
        assert_checkpoint_equivalent(model, torch.ones(2, 2), backward="twice")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="target Linear is not a submodule of the model"):
        assert_checkpoint_equivalent(model, torch.ones(2, 2), targets=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="default_loss found no floating-point tensor"):
        default_loss(torch.ones(2, dtype=torch.long))


class NudgedInRecompute(nn.Module):
    """A user layer whose recompute is off by one part in 2**20: far inside allclose."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1 + 2**-20 if scopedckpt.is_recomputing() else 1.0
        return (x * scale).square()


def test_a_recompute_off_by_one_part_in_a_million_is_reported() -> None:
    """The comparison is bitwise: a relative error of 2**-20 must not pass as equal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), NudgedInRecompute())
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "scopedckpt: step 0: gradient of parameter '0.weight' differs between the "
            "checkpointed and the plain run: max abs diff "
        ),
    ):
        assert_checkpoint_equivalent(model, torch.randn(5, 4))


def test_an_exact_user_layer_passes() -> None:
    """The control for the test above: without the nudge the same model is exact."""

    class Square(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 1.0).square()

    torch.manual_seed(0)
    assert_checkpoint_equivalent(nn.Sequential(nn.Linear(4, 4), Square()), torch.randn(5, 4))
