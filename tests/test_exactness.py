"""The product's promise: checkpointed training is bit-for-bit plain training."""

from __future__ import annotations

from hypothesis import given, note
from hypothesis import strategies as st

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
