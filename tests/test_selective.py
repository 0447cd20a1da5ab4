"""Selective saving (``save=``): kept ops are not rerun, and training stays exact."""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import scopedckpt
from scopedckpt import policies
from scopedckpt.testing import assert_checkpoint_equivalent

from .strategies import Case, cases, save_policies

aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that really run (outside every scopedckpt mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _block(inplace: bool = True) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(inplace=inplace),
        nn.Dropout(0.25),
        nn.Linear(32, 16),
        scopedckpt.Dropout(0.25),
    )


def _model(inplace: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_block(inplace) for _ in range(3)])


def _counted_step(model: nn.Module, save: Any, **kw: Any) -> collections.Counter[str]:
    x = torch.randn(8, 16, requires_grad=True)
    with OpCounter() as counter:
        with scopedckpt.checkpointing(*model, save=save, **kw):
            y = model(x)
        y.square().mean().backward()
    return counter.counts


POLICIES = {
    "packet": [aten.addmm],
    "overload": [aten.addmm.default, aten.native_batch_norm.default],
    "class": [nn.Linear],
    "pattern": ["0", "4"],
    "callable": [lambda ctx, op, *a, **k: op is aten.addmm.default],
    "torch-enum callable": [
        lambda ctx, op, *a, **k: (
            CheckpointPolicy.MUST_SAVE
            if op is aten.addmm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )
    ],
    "preset": policies.save_matmuls,
}


@pytest.mark.parametrize("backward", ["backward", "retain_graph", "grad_then_backward"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policies_train_identically(name: str, backward: str) -> None:
    """Every kind of item, with BN + inplace ReLU, nn.Dropout and scoped dropout."""
    assert_checkpoint_equivalent(
        _model(), torch.randn(8, 16), steps=2, backward=backward, save=POLICIES[name]
    )


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_saved_matmuls_are_not_rerun(name: str) -> None:
    """Without a policy the recompute reruns the linears; with one it does not."""
    model = _model()
    full = _counted_step(model, None)
    saved = _counted_step(model, POLICIES[name])
    forward_only = 6  # 3 blocks x 2 linears
    assert full["aten.addmm"] > forward_only
    assert saved["aten.addmm"] == forward_only
    assert saved["aten.bernoulli_"] == full["aten.bernoulli_"]  # dropout is recomputed


def test_module_instances_select_every_op_inside() -> None:
    model = _model(inplace=False)
    counts = _counted_step(model, [model[0][1], model[1][1], model[2][1]])
    assert counts["aten.native_batch_norm"] == 3  # saved: forward only
    assert counts["aten.addmm"] > 6


def test_batch_norm_saved_then_changed_in_place_is_recomputed_exactly() -> None:
    """torch's SAC raises "Tensor cached ... has been mutated" here (BN + ReLU(inplace)):
    the kept output no longer holds the op's result, so the op runs again."""
    model = _model(inplace=True)
    policy = [aten.native_batch_norm]
    block = _model(inplace=True)[0]
    context = functools.partial(
        create_selective_checkpoint_contexts, [aten.native_batch_norm.default]
    )
    x = torch.randn(8, 16, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context)
    with pytest.raises(RuntimeError, match="has been mutated"):
        y.sum().backward()
    counts = _counted_step(model, policy)
    assert counts["aten.native_batch_norm"] == 6  # rerun, its saving lost
    assert_checkpoint_equivalent(model, torch.randn(8, 16), steps=2, save=policy)
    # Without the in-place ReLU it is kept, and batch norm is updated once.
    plain = _model(inplace=False)
    assert _counted_step(plain, policy)["aten.native_batch_norm"] == 3
    assert_checkpoint_equivalent(plain, torch.randn(8, 16), steps=2, save=policy)


def test_torch_sac_updates_batch_norm_twice_and_ours_once() -> None:
    block = _model(inplace=False)[0]
    context = functools.partial(
        create_selective_checkpoint_contexts, [aten.native_batch_norm.default]
    )
    x = torch.randn(8, 16, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context)
    y.sum().backward()
    assert int(block[1].num_batches_tracked) == 2  # torch: twice
    ours = _model(inplace=False)[0]
    with scopedckpt.checkpointing(ours, save=[aten.native_batch_norm]):
        y = ours(x)
    y.sum().backward()
    assert int(ours[1].num_batches_tracked) == 1


class RandomThenRandom(nn.Module):
    """An out-of-place random op followed by an unscoped one: if the first is kept and
    skipped in the recompute, the second must still see the first forward's stream."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x) * torch.bernoulli(torch.sigmoid(x))
        return nn.functional.dropout(x, 0.5)


def test_kept_random_op_keeps_the_stream_aligned() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(RandomThenRandom(), RandomThenRandom())
    assert_checkpoint_equivalent(
        model, torch.randn(4, 8), steps=2, backward="retain_graph", save=[aten.bernoulli]
    )
    counts = _counted_step_8(model, [aten.bernoulli])
    assert counts["aten.bernoulli"] == 2  # first forward only


def _counted_step_8(model: nn.Module, save: Any) -> collections.Counter[str]:
    x = torch.randn(4, 8, requires_grad=True)
    with OpCounter() as counter:
        with scopedckpt.checkpointing(*model, save=save):
            y = model(x)
        y.square().mean().backward()
    return counter.counts


class WithFactory(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rand_like(x) + torch.zeros(x.shape[-1])


@pytest.mark.parametrize(
    ("item", "why"),
    [
        (aten.relu_, "changes its arguments in place"),
        (aten.add_.Tensor, "changes its arguments in place"),
        (aten.t, "returns a view"),
        (aten.rand_like, "tensor factory"),
        (aten.zeros.default, "tensor factory"),
        (lambda ctx, op, *a, **k: op is aten.relu_.default, "in place"),
        (lambda ctx, op, *a, **k: True, "returns a view"),
    ],
)
def test_an_op_that_cannot_be_kept_is_refused_by_name(item: Any, why: str) -> None:
    model = _model(inplace=True)
    model[0][0] = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), WithFactory())
    x = torch.randn(8, 16)
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=r"save= selects aten\.") as error,
        scopedckpt.checkpointing(*model, save=[item]),
    ):
        model(x)
    assert why in str(error.value)
    assert "Sequential" in str(error.value)  # the region


@pytest.mark.parametrize("backward", ["backward", "retain_graph"])
@pytest.mark.parametrize(
    "save", [[nn.Sequential], [scopedckpt.Dropout], [nn.BatchNorm1d, nn.Dropout]], ids=str
)
def test_module_selection_recomputes_in_place_ops_and_views(save: Any, backward: str) -> None:
    """Inside a selected module, in-place ops, views and factories rerun; nothing raises.
    (Unconverted batch norm: the buffer guard's copies must not be kept.)"""
    model = _model(inplace=True)
    assert_checkpoint_equivalent(model, torch.randn(8, 16), steps=2, backward=backward, save=save)


def test_nested_regions_keep_their_own_outputs() -> None:
    torch.manual_seed(0)
    inner = nn.ModuleList([_block(), _block()])

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.head = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.inner:
                x = scopedckpt.checkpoint(block, x, save=[aten.native_batch_norm])
            return self.head(x)

    model = Outer()
    for backward in ("backward", "retain_graph", "grad_then_backward"):
        assert_checkpoint_equivalent(
            model,
            torch.randn(8, 16),
            targets=[model],
            steps=2,
            backward=backward,
            save=policies.save_matmuls,
        )


def test_checkpoint_save_overrides_the_scope() -> None:
    model = _model(inplace=False)
    x = torch.randn(8, 16, requires_grad=True)
    with OpCounter() as counter:
        with scopedckpt.checkpointing(save=[aten.native_batch_norm]):
            y = x
            for block in model:
                y = scopedckpt.checkpoint(block, y, save=[aten.addmm])
        y.sum().backward()
    assert counter.counts["aten.addmm"] == 6
    assert counter.counts["aten.native_batch_norm"] == 6


def test_inner_scope_inherits_or_replaces_the_policy() -> None:
    model = _model(inplace=False)
    x = torch.randn(8, 16, requires_grad=True)
    with OpCounter() as counter:
        with scopedckpt.checkpointing(*model, save=[aten.addmm]), scopedckpt.checkpointing():
            y = model(x)
        y.sum().backward()
    assert counter.counts["aten.addmm"] == 6


def test_checkpoint_sequential_takes_save() -> None:
    model = nn.Sequential(*_model(inplace=False))
    x = torch.randn(8, 16, requires_grad=True)
    with OpCounter() as counter:
        with scopedckpt.checkpointing():
            y = scopedckpt.checkpoint_sequential(model, 3, x, save=[aten.addmm])
        y.sum().backward()
    assert counter.counts["aten.addmm"] == 6


def test_patterns_need_a_module_region() -> None:
    block = _block()
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match="not a module"),
        scopedckpt.checkpointing(save=["0"]),
    ):
        scopedckpt.checkpoint(lambda x: block(x), torch.randn(8, 16, requires_grad=True))


@pytest.mark.parametrize("bad", [3, "mlp.*", [3.5], [object()]])
def test_bad_policies_are_type_errors(bad: Any) -> None:
    with pytest.raises(TypeError, match="save="):
        scopedckpt.checkpointing(save=bad)


def test_a_recompute_running_other_shapes_raises() -> None:
    linear = nn.Linear(8, 8)
    state = {"n": 4}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return linear(x[: state["n"]]).relu()

    x = torch.randn(6, 8, requires_grad=True)
    with scopedckpt.checkpointing(save=[aten.addmm]):
        y = scopedckpt.checkpoint(fn, x, determinism_check="none")
    state["n"] = 5
    with pytest.raises(scopedckpt.ScopedCkptError, match=r"made call #0 of aten\.addmm"):
        y.sum().backward()


def test_memory_report_moves_kept_outputs_from_freed_to_kept() -> None:
    """Kept bytes: full checkpointing < save_matmuls < no checkpointing at all."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)]
    )
    x = torch.randn(32, 64, requires_grad=True)

    def report(save: Any) -> scopedckpt.MemoryReport:
        with scopedckpt.memory_report(model) as result:
            with scopedckpt.checkpointing(*model, save=save):
                y = model(x)
            y.sum().backward()
        return result

    def kept(r: scopedckpt.MemoryReport) -> int:
        return sum(row["kept_bytes"] for row in r.rows)

    def freed(r: scopedckpt.MemoryReport) -> int:
        return sum(row["freed_bytes"] for row in r.rows)

    full, selective = report(None), report(policies.save_matmuls)
    everything = kept(full) + freed(full)  # what the regions would hold without checkpointing
    assert kept(full) < kept(selective) < everything
    # The first linear's output is saved by GELU for backward and kept by the policy.
    first = 32 * 256 * 4
    assert freed(full) - freed(selective) == 3 * first


@given(
    case=cases(max_steps=2),
    data=st.data(),
    backward=st.sampled_from(["backward", "retain_graph", "grad_then_backward"]),
)
def test_random_policies_on_random_models_train_identically(
    case: Case, data: st.DataObject, backward: str
) -> None:
    """The exactness property with a random ``save=`` policy over the model's ops,
    module classes and instances, and callables (one that keeps every op it can)."""
    policy = data.draw(save_policies(case.model))
    note(repr(case))
    note(f"save={policy!r}")
    assert_checkpoint_equivalent(
        case.model,
        case.x,
        targets=(),
        steps=case.steps,
        seed=case.seed,
        backward=backward,
        save=policy,
    )


def test_ops_a_layer_issues_in_forward_only_do_not_shift_other_layers_records() -> None:
    """Found by the thorough property: scoped batch norm with momentum=None reads
    num_batches_tracked (an item()) in forward, not in its recompute; numbered per op
    alone, a later dropout's kept seed (also an item()) went to the wrong call."""
    from .strategies import ProgramModel, Region

    torch.manual_seed(0)
    pool = [
        scopedckpt.AlphaDropout(0.5),
        scopedckpt.BatchNorm1d(1, momentum=None, affine=False),
    ]
    inner = Region((Region((0, 1, 0, 0), early_stop=False),), early_stop=False)
    model = ProgramModel(pool, (Region((0, inner, 0), early_stop=False),))
    x = torch.tensor([[1.5410], [-0.2934]])
    assert_checkpoint_equivalent(model, x, targets=(), save=[scopedckpt.AlphaDropout])


class CountsThenClones(nn.Module):
    """Clones right after calling a module the buffer guard copies the buffers of."""

    def __init__(self) -> None:
        super().__init__()
        from .strategies import Counter

        self.linear, self.counter = nn.Linear(4, 4), Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.counter(self.linear(x)).clone().sin()


def test_scopedckpt_own_copies_are_never_kept() -> None:
    """The buffer guard copies the counter's buffer before its call in the first forward
    (a recompute copies when it starts, outside every call). Those copies are no ops of
    the region's: numbered, the user's clone after the call would take the next number,
    which the recompute's clone does not, and the recompute would be served the guard's
    copy for it."""

    def keep_clones_and_sines(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op in (aten.clone.default, aten.sin.default)

    def train(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = CountsThenClones()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            scope = scopedckpt.checkpointing(model, save=[keep_clones_and_sines])
            with scope if checkpointed else contextlib.nullcontext():
                loss = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step)))
            optimizer.zero_grad()
            loss.square().sum().backward()
            optimizer.step()
        return [*model.parameters(), *model.buffers()]

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)


def test_dropout_masks_run_past_the_numbering_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large CPU dropout mask is about sixty ops that both runs draw alike from its seed:
    they run with selective saving's mode off the stack (``core/_own_ops.aside``), not
    through a Python call each, while the model's ops are numbered; training stays exact."""
    from scopedckpt.mechanisms._selective import _RegionMode

    seen: collections.Counter[str] = collections.Counter()
    numbered = _RegionMode.__torch_dispatch__

    def counting(self: Any, func: Any, *rest: Any, **kwargs: Any) -> Any:
        seen[func.overloadpacket.__name__] += 1
        return numbered(self, func, *rest, **kwargs)

    monkeypatch.setattr(_RegionMode, "__torch_dispatch__", counting)

    def train(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = scopedckpt.convert(nn.Sequential(nn.Linear(1024, 1024), nn.Dropout(0.3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            scope = scopedckpt.checkpointing(model, save=policies.save_matmuls)
            with scope if checkpointed else contextlib.nullcontext():
                loss = model(torch.randn(128, 1024)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return list(model.parameters())

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)
    assert seen["addmm"] == 6  # three first forwards and three recomputes
    assert not seen["bitwise_xor_"] and not seen["lt"], seen


@pytest.mark.parametrize(
    "save",
    [["self_attn"], ["linear*", "norm1"], policies.save_attention, policies.save_compute],
    ids=str,
)
def test_transformer_layers_with_name_patterns_and_presets(save: Any) -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(
        *[nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True) for _ in range(2)]
    )
    assert_checkpoint_equivalent(
        layers, torch.randn(3, 5, 16), steps=2, backward="grad_then_backward", save=save
    )


def test_torch_checkpoint_calls_under_the_patch_take_the_scopes_policy() -> None:
    """Library code calling torch.utils.checkpoint gets the scope's save= too."""
    model = _model(inplace=False)
    x = torch.randn(8, 16, requires_grad=True)
    with OpCounter() as counter:
        with (
            scopedckpt.integrations.patch_torch_checkpoint(),
            scopedckpt.checkpointing(save=[aten.addmm]),
        ):
            y = x
            for block in model:
                y = torch.utils.checkpoint.checkpoint(block, y, use_reentrant=False)
        y.sum().backward()
    assert counter.counts["aten.addmm"] == 6


def test_backward_on_another_thread_serves_the_kept_outputs() -> None:
    import threading

    torch.manual_seed(0)
    model = _model(inplace=True)
    expected = _model(inplace=True)
    x = torch.randn(8, 16)
    torch.manual_seed(1)
    with scopedckpt.checkpointing(*model, save=policies.save_matmuls):
        loss = model(x).square().mean()
    torch.manual_seed(1)
    plain = expected(x).square().mean()
    plain.backward()
    thread = threading.Thread(target=loss.backward)
    thread.start()
    thread.join()
    assert torch.equal(loss, plain)
    for a, b in zip(model.parameters(), expected.parameters()):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(model.buffers(), expected.buffers()):
        assert torch.equal(a, b)
