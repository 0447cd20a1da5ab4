"""The region tape: every recompute call must find its own record (NOTE [ tape ])."""

from __future__ import annotations

import re

import pytest
import torch

import scopedckpt
from scopedckpt.core._state import DEFAULT_SCOPE, Frame, Phase, Record, RegionCall, Scope, Tape


def _recompute_frame(*records: Record) -> Frame:
    return Frame(Phase.RECOMPUTE, Tape(list(records)), Scope(enabled=True, strict=False))


def test_swapping_two_dropouts_between_forward_and_recompute_raises_naming_both() -> None:
    """Two layers of one kind swapping call order must not silently swap their masks."""
    first, second = scopedckpt.Dropout(0.25), scopedckpt.Dropout(0.75)

    def flips(x: torch.Tensor) -> torch.Tensor:
        if scopedckpt.is_recomputing():
            return first(second(x))
        return second(first(x))

    x = torch.randn(4, 6, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(flips, x)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape(
            "scopedckpt: the recompute of a function's region (checkpoint a module to name it "
            "by its path) made its scoped calls in another order: move data-dependent "
            "branches out of it.\nThe recompute made call #0 as dropout of Dropout(p=0.75, "
            "inplace=False), but the first forward made call #0 as dropout of Dropout(p=0.25, "
            "inplace=False). Replaying would use the wrong mask or statistics; the region's "
            "control flow must not depend on data that changes between forward and backward."
        ),
    ):
        out.sum().backward()


def test_swapping_two_batch_norms_between_forward_and_recompute_raises() -> None:
    first, second = scopedckpt.BatchNorm1d(6), scopedckpt.BatchNorm1d(6, eps=1e-3)

    def flips(x: torch.Tensor) -> torch.Tensor:
        if scopedckpt.is_recomputing():
            return first(second(x))
        return second(first(x))

    x = torch.randn(4, 6, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(flips, x)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape(
            "made call #0 as batch_norm of BatchNorm1d(6, eps=0.001, momentum=0.1, "
            "affine=True, bias=True, track_running_stats=True), but the first forward made "
            "call #0 as batch_norm of BatchNorm1d(6, eps=1e-05,"
        ),
    ):
        out.sum().backward()


def test_take_checks_the_owner_as_well_as_the_kind() -> None:
    mine, other = scopedckpt.Dropout(0.1), scopedckpt.Dropout(0.9)
    frame = _recompute_frame(Record("dropout", id(mine), mine, 123))
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape(
            "made call #0 as dropout of Dropout(p=0.9, inplace=False), but the first "
            "forward made call #0 as dropout of Dropout(p=0.1, inplace=False)."
        ),
    ):
        frame.take("dropout", id(other), other)
    assert frame.cursor == 0  # a failed take does not consume the record
    assert frame.take("dropout", id(mine), mine).value == 123
    assert frame.cursor == 1


def test_take_checks_the_kind() -> None:
    layer = scopedckpt.BatchNorm1d(2)
    frame = _recompute_frame(Record("dropout", id(layer), layer, None))
    with pytest.raises(scopedckpt.ScopedCkptError, match=re.escape("#0 as batch_norm of")):
        frame.take("batch_norm", id(layer), layer)


def test_take_past_the_end_names_the_call_and_the_record_count() -> None:
    layer = scopedckpt.Dropout(0.5)
    frame = _recompute_frame(Record("dropout", id(layer), layer, 1))
    frame.take("dropout", id(layer), layer)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape(
            "made more scoped calls than its first forward: move data-dependent branches out "
            "of it.\nIts scoped call #1 (dropout of Dropout(p=0.5, inplace=False)) has nothing "
            "to replay: the first forward made only 1 scoped calls."
        ),
    ):
        frame.take("dropout", id(layer), layer)


def test_records_without_owner_replay_for_an_ownerless_call_only() -> None:
    """Function regions record owner None; a module-owned call may not take them."""
    layer = scopedckpt.Dropout(0.5)
    frame = _recompute_frame(Record("region", None, len, "tape"), Record("region", None, len, 2))
    assert frame.take("region", None, len).value == "tape"
    with pytest.raises(scopedckpt.ScopedCkptError, match=re.escape("#1 as region of Dropout(")):
        frame.take("region", id(layer), layer)


def test_two_dropouts_in_the_same_order_replay_their_own_masks() -> None:
    """The counterpart of the swap test: same order, exact gradients."""
    first, second = scopedckpt.Dropout(0.25), scopedckpt.Dropout(0.75)
    lin = torch.nn.Linear(6, 6)
    x = torch.randn(4, 6)

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        xi = x.clone().requires_grad_()
        lin.zero_grad(set_to_none=True)
        with scopedckpt.checkpointing(enabled=checkpointed):
            out = scopedckpt.checkpoint(lambda t: second(lin(first(t))), xi)
        (out * torch.arange(6.0)).sum().backward()
        return [out, xi.grad, lin.weight.grad]

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)


def test_a_region_call_sorts_its_arguments_once_for_every_mechanism() -> None:
    """Tensors (parameters included) with their version counters, everything else as given,
    each by position or keyword, in call order."""
    x, w = torch.randn(2), torch.nn.Parameter(torch.randn(2))
    x.add_(1)
    marker = object()
    call = RegionCall(None, "f", DEFAULT_SCOPE, (x, "s", w), {"k": marker, "y": x}, True, None)
    assert [(key, t, version) for key, t, version in call.tensors] == [
        (0, x, 1),
        (2, w, 0),
        ("y", x, 1),
    ]
    assert call.others == [(1, "s"), ("k", marker)]
    x.add_(1)  # noted when the region starts, not read again
    assert call.tensors[0][2] == 1
