"""A region whose forward changes its own input in place raises, naming the region
(``_inputs.py``; issue 25, hole 7)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import scopedckpt


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    block = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))
    return nn.Sequential(nn.Linear(4, 4), block, nn.Linear(4, 1))


def test_an_in_place_first_op_names_the_region_and_the_fix() -> None:
    model = _model()
    x = torch.randn(3, 4)
    model(x).sum().backward()  # plain training works
    with scopedckpt.checkpointing(model[1], root=model):
        with pytest.raises(scopedckpt.ScopedCkptError, match=re.escape("'1' (Sequential)")) as e:
            model(x)
    assert "positional argument #0" in str(e.value) and "inplace=False" in str(e.value)


def test_the_error_comes_at_the_forward_not_at_torchs_backward() -> None:
    """Torch's checkpoint fails only in backward, naming no region; scopedckpt fails at
    the end of the region's forward, naming it."""
    w = torch.randn(4, 4, requires_grad=True)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2) @ w

    out = torch_checkpoint.checkpoint(scaled, torch.ones(2, 4), use_reentrant=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    with scopedckpt.checkpointing():
        with pytest.raises(scopedckpt.ScopedCkptError, match="scaled"):
            scopedckpt.checkpoint(scaled, torch.ones(2, 4))


def test_inputs_read_but_not_written_pass_and_keywords_are_checked() -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def fn(x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
        return (x + y.add_(1)) @ w

    with scopedckpt.checkpointing():
        scopedckpt.checkpoint(lambda x: x @ w, torch.ones(2, 4)).sum().backward()
        with pytest.raises(scopedckpt.ScopedCkptError, match="keyword argument 'y'"):
            scopedckpt.checkpoint(fn, torch.ones(2, 4), y=torch.ones(2, 4))
