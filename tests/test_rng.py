"""Unscoped randomness is replayed exactly (NOTE [ RNG replay ], NOTE [ aligned draws ])."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scopedckpt
from scopedckpt.mechanisms import _rng
from scopedckpt.testing import assert_checkpoint_equivalent


class Functional(nn.Module):
    """Randomness that no module owns: F.dropout, bernoulli_, rand, randperm, multinomial."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.lin(x), 0.3, self.training)
        h = h * x.new_empty(x.shape[0], 1).bernoulli_(0.7)
        h = h + torch.rand_like(h) + torch.randn(h.shape) * 0.1
        h = h[:, torch.randperm(h.shape[1])]
        return h * torch.multinomial(torch.ones(h.shape[1]), h.shape[1]).float()


def test_unscoped_random_ops_are_replayed_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Functional(), Functional())
    for backward in ("backward", "retain_graph", "grad_then_backward", "none"):
        assert_checkpoint_equivalent(model, torch.randn(4, 6), steps=3, backward=backward)


class Mixed(nn.Module):
    """A scoped draw, then unscoped ones: the order timm's ViT block uses."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.proj_drop = scopedckpt.Dropout(0.3, generator=generator)
        self.unscoped = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_drop(self.lin(x))
        keep = x.new_empty(x.shape[0], 1).bernoulli_(0.6)  # drop path
        return x + self.unscoped(h) * keep / 0.6


@pytest.mark.parametrize("user_generator", [False, True])
def test_scoped_and_unscoped_draws_mix_in_any_order(user_generator: bool) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3) if user_generator else None
    model = nn.Sequential(Mixed(generator), Mixed(generator), Mixed(generator))
    assert_checkpoint_equivalent(model, torch.randn(5, 6), steps=3, backward="retain_graph")
    assert_checkpoint_equivalent(
        model, torch.randn(5, 6), targets=[model, model[1]], steps=2, backward="grad_then_backward"
    )


def test_global_rng_state_after_a_step_is_that_of_a_plain_step() -> None:
    torch.manual_seed(0)
    block = Mixed()
    x = torch.randn(4, 6)

    def state_after(checkpointed: bool) -> torch.Tensor:
        torch.manual_seed(1)
        with scopedckpt.checkpointing(enabled=checkpointed):
            loss = scopedckpt.checkpoint(copy.deepcopy(block), x.requires_grad_()).sum()
        loss.backward()
        return torch.get_rng_state()

    assert torch.equal(state_after(True), state_after(False))


def test_without_the_stash_scoped_layers_stay_exact_and_unscoped_ones_do_not() -> None:
    torch.manual_seed(0)
    scoped = nn.Sequential(nn.Linear(6, 6), scopedckpt.Dropout(0.5))
    unscoped = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
    x = torch.randn(4, 6)

    def grad(model: nn.Module, checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        m = copy.deepcopy(model)
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        with scopedckpt.checkpointing(enabled=checkpointed):
            out = scopedckpt.checkpoint(m, xi, preserve_rng_state=False)
        out.square().sum().backward()
        return xi.grad, torch.get_rng_state()

    for a, b in zip(grad(scoped, True), grad(scoped, False)):
        assert torch.equal(a, b)
    # Unscoped dropout is not replayed: the default sampled verification says so on the
    # first call, and without it the gradients are silently wrong.
    with pytest.raises(scopedckpt.ScopedCkptError, match="bitwise verification failed"):
        grad(unscoped, True)
    previous = scopedckpt.set_verification_sampling(0)
    try:
        assert not torch.equal(grad(unscoped, True)[0], grad(unscoped, False)[0])
    finally:
        scopedckpt.set_verification_sampling(previous)


def test_a_diverged_stream_raises_instead_of_replaying_wrong_masks() -> None:
    """An extra unscoped draw in the recompute only: the scoped redraw notices."""
    drop = scopedckpt.Dropout(0.5)
    calls: list[int] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:
            torch.rand(3)  # drawn only in the recompute
        return drop(x)

    x = torch.randn(4, 6, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(body, x)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape("from torch's default generator, but its first forward drew"),
    ):
        out.sum().backward()


class FakeDevice:
    """An accelerator's default generator, as the stash sees it (no device needed)."""

    def __init__(self) -> None:
        self.state = torch.tensor([0])
        self.sets: list[int] = []

    def draw(self) -> int:
        self.state = self.state + 1
        return int(self.state)

    def access(self) -> _rng.Access:
        def set_state(state: torch.Tensor) -> None:
            self.sets.append(int(state))
            self.state = state.clone()

        return (lambda: self.state.clone(), set_state)


def test_accelerator_generators_are_stashed_and_rewound(monkeypatch: pytest.MonkeyPatch) -> None:
    device = FakeDevice()
    monkeypatch.setattr(_rng, "DEVICE_GENERATORS", lambda: [device.access()])
    draws: list[int] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        draws.append(device.draw())  # a "CUDA" random op
        return x.sin()  # saves x: backward recomputes

    x = torch.ones(2, requires_grad=True)
    device.draw()
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(body, x)
    device.draw()  # the stream moves on after the region
    after_forward = int(device.state)
    out.sum().backward()
    assert draws == [2, 2]  # the recompute drew what the forward drew
    assert int(device.state) == after_forward  # and the stream was put back
    assert device.sets == [1, 3]


def test_accelerator_discovery_matches_torchs_own_answer() -> None:
    """CPU builds, and CUDA builds on a machine without a GPU: no accelerator, no
    generators; with a device, its module, and generators once it is initialised."""
    module = _rng._accelerator_module()
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        assert module is None and _rng._accelerator_generators() == []
    else:
        assert module is torch.get_device_module(accelerator.type)
        assert bool(_rng._accelerator_generators()) == bool(module.is_initialized())


def test_accelerator_discovery_finds_a_device_initialised_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The build's accelerator is looked up once; whether it is initialised, until it is."""

    class Module:  # stands for torch.cuda
        def __init__(self) -> None:
            self.initialised = False
            self.states = {0: torch.tensor([0]), 1: torch.tensor([1])}

        def is_initialized(self) -> bool:
            return self.initialised

        def device_count(self) -> int:
            return 2

        def get_rng_state(self, index: int) -> torch.Tensor:
            return self.states[index].clone()

        def set_rng_state(self, state: torch.Tensor, index: int) -> None:
            self.states[index] = state.clone()

    module = Module()
    monkeypatch.setattr(_rng, "_ACCELERATOR", (module,))
    monkeypatch.setattr(_rng, "_ACCESSES", None)
    assert _rng._accelerator_generators() == []
    assert _rng.stash().devices == ()
    module.initialised = True  # a region must not initialise it, but finds it once it is
    accesses = _rng._accelerator_generators()
    assert len(accesses) == 2 and _rng._accelerator_generators() is accesses
    stashed = _rng.stash()
    module.states[1] = torch.tensor([7])
    stashed.apply()
    assert [int(module.states[i]) for i in (0, 1)] == [0, 1]
    module.initialised = False  # as in a child forked from an initialised process
    assert _rng._accelerator_generators() == []


def test_strict_mode_accepts_attention_without_dropout() -> None:
    """aten._scaled_dot_product_flash_attention_for_cpu is tagged random even at p=0."""
    q = torch.randn(2, 2, 4, 8, requires_grad=True)
    with scopedckpt.checkpointing(strict=True):
        out = scopedckpt.checkpoint(lambda t: F.scaled_dot_product_attention(t, t, t), q)
        F.dropout(q, 0.5, training=False)
    out.sum().backward()
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match="strict mode found the random op"),
        scopedckpt.checkpointing(strict=True),
    ):
        scopedckpt.checkpoint(lambda t: F.scaled_dot_product_attention(t, t, t, dropout_p=0.1), q)


def test_strict_mode_names_draws_from_a_generator_of_their_own() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    with (
        pytest.raises(
            scopedckpt.ScopedCkptError,
            match=re.escape("on its own generator in a function's region"),
        ),
        scopedckpt.checkpointing(strict=True),
    ):
        scopedckpt.checkpoint(lambda t: t * torch.rand(3, generator=generator), x)
