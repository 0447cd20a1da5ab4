"""Explicit generators (``generator=g``) in regions: found by verified first forwards,
stashed at every region of their site, replayed by recomputes (NOTE [ explicit
generators ] in ``_generators.py``; issue 25, hole 6)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scopedckpt


class Noisy(nn.Module):
    """Adds noise from its own generator; ``last``: as the region's last op, where no
    saved tensor shows it (only the generator's state would), and which the recompute
    stops before (so it must put the generator's state back)."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.last = last
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.last:  # after the last saved tensor: torch's early stop skips the draw
            y = self.linear(x).tanh()
            return y + torch.randn(x.shape, generator=self.generator)
        noise = torch.randn(x.shape, generator=self.generator)
        return self.linear(x + noise).tanh()


def _train(last: bool, checkpointed: bool, steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Noisy(last), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    seen: list[torch.Tensor] = []
    for _ in range(steps):
        if checkpointed:
            with scopedckpt.checkpointing(model[1], root=model):
                loss = model(x).sum()
        else:
            loss = model(x).sum()
        loss.backward(retain_graph=True)  # two recomputes
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad  # type: ignore[operator]
                seen.append(p.grad.clone())  # type: ignore[union-attr]
                p.grad = None
        seen.append(model[1].generator.get_state())
    return seen


@pytest.mark.parametrize("last", [False, True], ids=["inside", "last"])
def test_a_region_drawing_from_its_own_generator_trains_bit_identically(last: bool) -> None:
    """Found by the first (verified) call, replayed from then on: gradients and the
    generator's state after every step are plain training's."""
    plain = _train(last, checkpointed=False)
    checkpointed = _train(last, checkpointed=True)
    assert len(plain) == len(checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.usefixtures("no_sampling")
def test_without_a_verified_call_the_generator_is_not_seen() -> None:
    """The limit NOTE [ explicit generators ] states: found only by verified calls."""
    assert not all(torch.equal(a, b) for a, b in zip(_train(False, False), _train(False, True)))


def test_a_generator_found_once_is_stashed_by_the_sites_later_calls() -> None:
    from scopedckpt import _generators

    model = nn.Sequential(Noisy(last=True))
    x = torch.randn(3, 4)
    with scopedckpt.checkpointing(model[0], root=model):
        model(x).sum().backward()
    key = id(model[0])
    assert key in _generators._Sites.found
    (ref,) = _generators._Sites.found[key][1]
    assert ref() is model[0].generator
