"""The product's promise: checkpointed training is bit-for-bit plain training."""

from __future__ import annotations

import contextlib
import copy
import random

import torch
from hypothesis import given, note
from hypothesis import strategies as st

import scopedckpt
from scopedckpt.testing import assert_checkpoint_equivalent

from .strategies import Case, cases


@given(case=cases(), backward=st.sampled_from(["backward", "retain_graph", "grad_then_backward"]))
def test_random_models_train_identically(case: Case, backward: str) -> None:
    """Loss, outputs, grads, input grads, buffers and RNG state match after every step."""
    note(repr(case))
    assert_checkpoint_equivalent(
        case.model, case.x, targets=(), steps=case.steps, seed=case.seed, backward=backward
    )


@given(case=cases(max_steps=2))
def test_forward_without_backward_is_exact(case: Case) -> None:
    """A region never recomputed leaves buffers and RNG exactly as a plain forward."""
    assert_checkpoint_equivalent(
        case.model, case.x, targets=(), steps=case.steps, seed=case.seed, backward="none"
    )


def _train_flipping_modes(case: Case, checkpointed: bool) -> list[torch.Tensor]:
    """Train ``case.steps`` steps, switching every module's mode between each forward
    and its backward, and back after it; what each step leaves."""
    model = copy.deepcopy(case.model)
    torch.manual_seed(case.seed)
    random.seed(case.seed)  # PythonCoin layers draw from it
    seen: list[torch.Tensor] = []
    for _ in range(case.steps):
        x = case.x.clone().requires_grad_()
        with scopedckpt.checkpointing() if checkpointed else contextlib.nullcontext():
            loss = model(x).square().mean()
        model.train(not model.training)
        loss.backward()
        model.train(not model.training)
        grads = [x.grad] + [p.grad for p in model.parameters() if p.grad is not None]
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad
                    p.grad = None
        seen += [loss, torch.get_rng_state(), *grads, *model.buffers(), *model.parameters()]
        seen = [t.detach().clone() for t in seen]  # type: ignore[union-attr]
    return seen


@given(case=cases(max_steps=2))
def test_a_mode_switch_between_forward_and_backward_is_exact(case: Case) -> None:
    """``model.eval()`` (or ``.train()``) between forward and backward (issue 25, hole 7):
    the recompute runs in the first forward's modes, unconverted layers included."""
    note(repr(case))
    checkpointed = _train_flipping_modes(case, True)
    plain = _train_flipping_modes(case, False)
    assert len(checkpointed) == len(plain)
    for index, (a, b) in enumerate(zip(checkpointed, plain)):
        assert torch.equal(a, b), f"tensor {index} of {len(plain)} differs"
