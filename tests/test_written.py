"""Parameters and buffers a region's forward changes where no guard sees it: refused when
its forward ends, before any backward (NOTE [ unguarded writes ] in ``_written.py``;
issue 25, holes 3 and 4)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import scopedckpt


class Bank(nn.Module):
    """A memory bank updated through a method, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("queue", torch.zeros(8, 4))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.long))

    def push(self, keys: torch.Tensor) -> None:
        with torch.no_grad():
            i = int(self.pointer)
            self.queue[i : i + keys.shape[0]] = keys.detach()
            self.pointer.fill_((i + keys.shape[0]) % 8)


class WithBank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bank = Bank()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        bank = self.bank.queue.clone()  # as it is before this step's keys
        out = y + (y @ bank.T) @ bank
        self.bank.push(y)
        return out


class ParentWritesChild(nn.Module):
    """The parent's forward updates a child's buffer; the child is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.stats = nn.Module()
        self.stats.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        with torch.no_grad():
            self.stats.mean.mul_(0.9).add_(y.mean(0), alpha=0.1)
        return y - self.stats.mean


def _model(block: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), block, nn.Linear(4, 1))


def test_a_parameter_changed_in_place_in_forward_is_refused_naming_it() -> None:
    """nn.Embedding(max_norm=...) renormalizes its weight at every call (hole 3)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 4))
    model = nn.Sequential(block, nn.Linear(4, 1))
    tokens = torch.randint(0, 10, (6,))
    with scopedckpt.checkpointing(block, root=model):
        with pytest.raises(scopedckpt.ScopedCkptError) as error:
            model(tokens)
    message = str(error.value)
    assert "'0' (Sequential)" in message  # the region
    assert "parameter '0.weight'" in message  # the parameter, by qualified name
    assert "max_norm=None" in message  # the fix


@pytest.mark.parametrize("block", [WithBank, ParentWritesChild])
def test_a_buffer_of_a_module_the_region_never_calls_is_refused_naming_it(
    block: type[nn.Module],
) -> None:
    """A memory bank pushed through a method; a child's buffer the parent updates (hole 4)."""
    model = _model(block())
    with scopedckpt.checkpointing(model[1], root=model):
        with pytest.raises(scopedckpt.ScopedCkptError) as error:
            model(torch.randn(3, 4))
    message = str(error.value)
    assert "'1' (" in message
    assert "'1.bank' (Bank)" in message or "'1.stats' (Module)" in message
    assert "never called" in message


def test_the_same_models_unchecked_are_silently_wrong() -> None:
    """Why the refusal: without it the recompute reads the pushed bank (hole 4)."""
    model = _model(WithBank())
    plain = _model(WithBank())
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    from scopedckpt import _engine, _written

    mechanisms = _engine.MECHANISMS
    _engine.MECHANISMS = tuple(m for m in mechanisms if m is not _written)
    previous = scopedckpt.set_verification_sampling(0)
    try:
        with scopedckpt.checkpointing(model[1], root=model):
            loss = model(x).sum()
        loss.backward()
    finally:
        _engine.MECHANISMS = mechanisms
        scopedckpt.set_verification_sampling(previous)
    assert not torch.equal(model[1].linear.weight.grad, plain[1].linear.weight.grad)


class Holder(nn.Module):
    """Calls its first two children; ``extra`` (buffers, never called) is only held."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.extra = nn.Embedding(3, 4)
        self.extra.register_buffer("constant", torch.ones(4))
        self.count_in_forward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count_in_forward:
            self.late.count.add_(1)  # type: ignore[operator]
        return self.norm(self.linear(x))


def test_buffers_of_called_modules_and_untouched_ones_pass() -> None:
    """The guard's own case (a BatchNorm called in the region) and constant buffers."""
    model = _model(Holder())
    with scopedckpt.checkpointing(model[1], root=model):
        loss = model(torch.randn(3, 4)).sum()
    loss.backward()
    assert int(model[1].norm.num_batches_tracked) == 1


def test_listings_follow_modules_registered_later() -> None:
    """A buffer registered after a first region is checked in the next one."""
    model = _model(Holder())
    x = torch.randn(3, 4)
    with scopedckpt.checkpointing(model[1], root=model):
        model(x).sum().backward()
    model[1].late = nn.Module()
    model[1].late.register_buffer("count", torch.zeros(()))
    model[1].count_in_forward = True
    with scopedckpt.checkpointing(model[1], root=model):
        with pytest.raises(scopedckpt.ScopedCkptError, match=re.escape("'count' of '1.late'")):
            model(x)
