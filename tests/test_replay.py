"""The extension API: scopedckpt.replay and the Stateful protocol for users' own layers."""

from __future__ import annotations

import random
import re
from contextlib import nullcontext

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt.core._light import RecomputeDivergenceError
from scopedckpt.testing import assert_checkpoint_equivalent


class TokenDrop(nn.Module):
    """Keeps a random half of the tokens, chosen with Python's random: nothing rewinds it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        keep = scopedckpt.replay(self, lambda: sorted(self.rng.sample(range(n), n // 2)))
        return self.lin(x[:, keep])


class PythonCounter(nn.Module):
    """A step count kept in a Python attribute, restored through the protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls

    def scopedckpt_state(self) -> int:
        return self.calls

    def scopedckpt_restore(self, state: int) -> None:
        self.calls = state


def test_replay_returns_the_first_forwards_decision_in_every_recompute() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TokenDrop(1), TokenDrop(2))
    for backward in ("backward", "retain_graph", "grad_then_backward"):
        assert_checkpoint_equivalent(model, torch.randn(2, 8, 4), steps=3, backward=backward)


def test_without_replay_the_decision_would_differ() -> None:
    """The mutant check for replay: a decision made again in the recompute is caught."""

    class Forgetful(TokenDrop):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keep = sorted(self.rng.sample(range(x.shape[1]), x.shape[1] // 2))
            return self.lin(x[:, keep])

    torch.manual_seed(0)
    with pytest.raises(AssertionError, match="differs between the checkpointed and the plain"):
        model = nn.Sequential(Forgetful())
        assert_checkpoint_equivalent(model, torch.randn(2, 8, 4), steps=1)


def test_replay_outside_regions_just_decides() -> None:
    values = iter([1, 2])
    assert scopedckpt.replay(object(), lambda: next(values)) == 1
    assert scopedckpt.replay(object(), lambda: next(values)) == 2


def test_replay_checks_the_owner_like_scoped_layers() -> None:
    a, b = object(), object()
    calls: list[int] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        owner = a if len(calls) == 1 else b
        return x.sin() * scopedckpt.replay(owner, lambda: 2.0)

    x = torch.ones(2, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(body, x, early_stop=False)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape("made call #0 as decision of object(), but the first forward made"),
    ):
        out.sum().backward()


def test_stateful_protocol_restores_python_state_around_recomputes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(PythonCounter(), PythonCounter())
    assert isinstance(model[0], scopedckpt.Stateful)
    for backward in ("backward", "retain_graph", "grad_then_backward"):
        assert_checkpoint_equivalent(model, torch.randn(3, 4), steps=3, backward=backward)
        assert_checkpoint_equivalent(model, torch.randn(3, 4), targets=[model], steps=2)


class CountsInAList(nn.Module):
    """Counts its calls in a list it owns, changed in place: no attribute changes (the
    forward's world sees none), so only the protocol can give a recompute the count."""

    def __init__(self) -> None:
        super().__init__()
        self.count = [0]
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count[0] += 1
        return torch.tanh(self.lin(x) * (0.25 * self.count[0]))  # saves what the count scales

    def scopedckpt_state(self) -> int:
        return self.count[0]

    def scopedckpt_restore(self, state: int) -> None:
        self.count[0] = state


def test_a_recompute_starts_from_the_stateful_snapshot_of_its_first_forward() -> None:
    def train(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(CountsInAList(), nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            with scopedckpt.checkpointing(model[0]) if checkpointed else nullcontext():
                loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert model[0].count == [4]
        return list(model.parameters())

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)


def test_a_stateful_module_called_more_often_in_the_recompute_raises() -> None:
    counter = PythonCounter()
    calls: list[int] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        for _ in range(len(calls)):
            x = counter(x)
        return x

    x = torch.ones(2, 4, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(body, x, early_stop=False)
    with pytest.raises(RecomputeDivergenceError, match="took another path than its first forward"):
        out.sum().backward()
    assert counter.calls == 1  # the recompute's calls counted on the snapshot, put back
