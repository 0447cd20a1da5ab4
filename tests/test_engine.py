"""The region engine: phases, recomputes, nesting, errors."""

from __future__ import annotations

import contextlib
import copy
import re
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt import Phase
from scopedckpt.core._engine import COUNTERS


def _block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), scopedckpt.BatchNorm1d(6), nn.ReLU(), scopedckpt.Dropout(0.4)
    )


@contextlib.contextmanager
def _made(regions: int, recomputes: int) -> Iterator[None]:
    """Assert the block starts ``regions`` regions and runs ``recomputes`` recomputes:
    an exactness test whose checkpointed run made no region would compare plain with plain."""
    before = COUNTERS.regions, COUNTERS.recomputes
    yield
    made = COUNTERS.regions - before[0], COUNTERS.recomputes - before[1]
    assert made == (regions, recomputes), "(regions, recomputes) made"


def test_phase_is_set_in_forward_and_in_recompute_after_the_block() -> None:
    seen: list[Phase] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(scopedckpt.phase())
        return x.exp()

    x = torch.ones(3, requires_grad=True)
    assert scopedckpt.phase() is Phase.NONE
    with scopedckpt.checkpointing():
        y = scopedckpt.checkpoint(fn, x)
        assert scopedckpt.phase() is Phase.NONE
    y.sum().backward()  # the recompute runs here, outside the block
    assert seen == [Phase.FORWARD, Phase.RECOMPUTE]
    assert not scopedckpt.is_recomputing()


def test_checkpoint_outside_a_scope_is_a_plain_call() -> None:
    block = _block()
    x = torch.randn(4, 6, requires_grad=True)
    before = COUNTERS.regions
    out = scopedckpt.checkpoint(block, x)
    assert COUNTERS.regions == before
    assert out.grad_fn is not None


def test_checkpoint_under_no_grad_is_a_plain_call() -> None:
    before = COUNTERS.regions
    with scopedckpt.checkpointing(), torch.no_grad():
        scopedckpt.checkpoint(_block(), torch.randn(4, 6))
    assert COUNTERS.regions == before


def test_kwargs_and_tuple_outputs_pass_through() -> None:
    def fn(x: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x * scale, {"sq": x.square()}

    x = torch.ones(2, requires_grad=True)
    with scopedckpt.checkpointing():
        a, b = scopedckpt.checkpoint(fn, x, scale=3.0)
    (a.sum() + b["sq"].sum()).backward()
    assert torch.equal(x.grad, torch.full((2,), 5.0))


def test_recompute_context_is_reentered_for_every_recompute() -> None:
    block = _block()
    reference = copy.deepcopy(block)
    x = torch.randn(5, 6)
    torch.manual_seed(3)
    ref_loss = reference(x).square().sum()
    ref_grads = torch.autograd.grad(ref_loss, list(reference.parameters()), retain_graph=True)
    torch.manual_seed(3)
    with scopedckpt.checkpointing():
        loss = scopedckpt.checkpoint(block, x.requires_grad_()).square().sum()
    before = COUNTERS.recomputes
    grads = torch.autograd.grad(loss, list(block.parameters()), retain_graph=True)
    loss.backward(retain_graph=True)
    loss.backward()
    assert COUNTERS.recomputes - before == 3
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
    for p, r in zip(block.parameters(), ref_grads):
        assert torch.equal(p.grad, 2 * r)
    assert int(block[1].num_batches_tracked) == 1


def test_nested_region_recomputes_inside_outer_recompute_without_checkpoint_error() -> None:
    inner, outer = _block(), _block()
    x = torch.randn(4, 6, requires_grad=True)

    def body(t: torch.Tensor) -> torch.Tensor:
        return outer(scopedckpt.checkpoint(inner, t))

    ref_inner, ref_outer = copy.deepcopy(inner), copy.deepcopy(outer)
    torch.manual_seed(5)
    ref = ref_outer(ref_inner(x)).square().sum()
    ref.backward()
    ref_grad = x.grad.clone()
    x.grad = None
    torch.manual_seed(5)
    with _made(regions=2, recomputes=0), scopedckpt.checkpointing():
        loss = scopedckpt.checkpoint(body, x).square().sum()
    # The outer recompute makes the inner region again (a third region) and replays it
    # inside itself; backward then recomputes that inner region too.
    with _made(regions=1, recomputes=3):
        loss.backward()
    assert torch.equal(loss, ref)
    assert torch.equal(x.grad, ref_grad)
    assert int(inner[1].num_batches_tracked) == int(outer[1].num_batches_tracked) == 1


def test_backward_on_another_thread_is_exact() -> None:
    block, reference = _block(), _block()
    x = torch.randn(4, 6)
    torch.manual_seed(9)
    reference(x).square().sum().backward()
    torch.manual_seed(9)
    with _made(regions=1, recomputes=0), scopedckpt.checkpointing():
        loss = scopedckpt.checkpoint(block, x.requires_grad_()).square().sum()
    worker = threading.Thread(target=loss.backward)  # a fresh context: no scope there
    with _made(regions=0, recomputes=1):  # the recompute ran on the worker
        worker.start()
        worker.join()
    for p, r in zip(block.parameters(), reference.parameters()):
        assert torch.equal(p.grad, r.grad)
    assert torch.equal(block[1].running_mean, reference[1].running_mean)


def test_non_callable_fn_is_rejected() -> None:
    with pytest.raises(
        TypeError,
        match=re.escape(
            "scopedckpt: checkpoint expected a callable fn (a function or an nn.Module) as its "
            "first argument, but got Tensor."
        ),
    ):
        scopedckpt.checkpoint(torch.ones(2), torch.ones(2))


def test_bad_determinism_check_is_rejected() -> None:
    with pytest.raises(ValueError, match="scopedckpt: determinism_check must be one of"):
        scopedckpt.checkpoint(torch.sin, torch.ones(2), determinism_check="strict")


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_exception_in_a_region_leaves_no_scope_and_the_next_step_is_exact() -> None:
    block = _block()
    reference = copy.deepcopy(block)
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(ValueError, match="boom"), scopedckpt.checkpointing():
        scopedckpt.checkpoint(nn.Sequential(block, _Boom()), x)
    assert scopedckpt.phase() is Phase.NONE
    reference.load_state_dict(block.state_dict())  # the failed forward did update BN once
    torch.manual_seed(2)
    reference(x).sum().backward()
    torch.manual_seed(2)
    with _made(regions=1, recomputes=1):
        with scopedckpt.checkpointing():
            out = scopedckpt.checkpoint(block, x)
        out.sum().backward()
    for p, r in zip(block.parameters(), reference.parameters()):
        assert torch.equal(p.grad, r.grad)


def test_exception_in_backward_leaves_no_scope_behind() -> None:
    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("backward failed")

    x = torch.randn(4, 6, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(lambda t: Fail.apply(_block()(t)), x)
    with pytest.raises(RuntimeError, match="backward failed"):
        out.sum().backward()
    assert scopedckpt.phase() is Phase.NONE


def test_data_dependent_control_flow_raises_naming_the_layer_and_call() -> None:
    drop, bn = scopedckpt.Dropout(0.5), scopedckpt.BatchNorm1d(6)
    calls = []

    def branchy(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return drop(x) if len(calls) == 1 else bn(x)

    x = torch.randn(4, 6, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(branchy, x)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape(
            "made its scoped calls in another order: move data-dependent branches out of it."
            "\nThe recompute made call #0 as batch_norm of BatchNorm1d(6, eps=1e-05, "
            "momentum=0.1, affine=True, bias=True, track_running_stats=True), but the first "
            "forward made call #0 as dropout of Dropout(p=0.5, inplace=False)."
        ),
    ):
        out.sum().backward()


def test_recompute_with_more_scoped_calls_than_the_forward_raises() -> None:
    drop = scopedckpt.Dropout(0.5)
    calls = []

    def growing(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        for _ in range(len(calls)):
            x = drop(x)
        return x

    x = torch.randn(4, 6, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(growing, x, early_stop=False)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=r"made more scoped calls(.|\n)* call #1 .* only 1 scoped calls",
    ):
        out.sum().backward()


def test_user_generator_drives_the_seeds_and_leaves_the_global_stream_alone() -> None:
    def run(checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        drop = scopedckpt.Dropout(0.5, generator=torch.Generator().manual_seed(42))
        lin = nn.Linear(6, 6)
        x = torch.randn(4, 6, requires_grad=True)
        state = torch.get_rng_state()
        with _made(regions=int(checkpointed), recomputes=int(checkpointed)):
            with scopedckpt.checkpointing(enabled=checkpointed):
                out = scopedckpt.checkpoint(lambda t: drop(lin(t)), x)
            out.square().sum().backward()
        assert torch.equal(torch.get_rng_state(), state)
        return out, x.grad, lin.weight.grad

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_strict_mode_names_unscoped_random_ops() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    with (
        pytest.raises(
            scopedckpt.ScopedCkptError, match=r"strict mode found the random op aten\.bernoulli"
        ),
        scopedckpt.checkpointing(strict=True),
    ):
        scopedckpt.checkpoint(nn.Dropout(0.5), x)
    with (
        pytest.raises(
            scopedckpt.ScopedCkptError,
            match=r"random op aten\.rand\.default (.|\n)*scopedckpt\.convert",
        ),
        scopedckpt.checkpointing(strict=True),
    ):
        scopedckpt.checkpoint(lambda t: t * torch.rand(t.shape), x)


def test_strict_mode_accepts_scoped_layers_and_is_off_by_default() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    # Both are regions, forward and recompute: strict mode had a region to check.
    with _made(regions=1, recomputes=1), scopedckpt.checkpointing(strict=True):
        scopedckpt.checkpoint(_block(), x).sum().backward()
    with _made(regions=1, recomputes=1), scopedckpt.checkpointing():
        scopedckpt.checkpoint(nn.Dropout(0.5), x).sum().backward()  # not detected: off


def test_preserve_rng_state_opt_in_makes_unscoped_dropout_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
    x = torch.randn(4, 6)

    def grad(checkpointed: bool) -> torch.Tensor:
        m = copy.deepcopy(model)
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        with _made(regions=int(checkpointed), recomputes=int(checkpointed)):
            with scopedckpt.checkpointing(enabled=checkpointed):
                out = scopedckpt.checkpoint(m, xi, preserve_rng_state=True)
            out.square().sum().backward()
        return xi.grad

    assert torch.equal(grad(True), grad(False))


class DynamicCache:
    """Stands for transformers' cache: recognised by class name and module."""

    __module__ = "transformers.cache_utils"

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class CachingLayer(nn.Module):
    _can_checkpoint_with_cache = False

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        if cache is not None:
            cache.keys.append(x.detach())
        return self.lin(x)


def test_a_hugging_face_cache_in_a_region_is_refused_naming_the_layer() -> None:
    model = nn.Sequential(CachingLayer())
    x = torch.randn(2, 6, requires_grad=True)
    with (
        pytest.raises(
            scopedckpt.ScopedCkptError,
            match=re.escape(
                "scopedckpt: the forward of '0' (CachingLayer) got a Hugging Face DynamicCache "
                "as keyword argument 'cache' in a region: pass use_cache=False while training."
            ),
        ),
        scopedckpt.checkpointing(model[0], root=model),
    ):
        model[0](x, cache=DynamicCache())
    with pytest.raises(scopedckpt.ScopedCkptError, match="Pass use_cache=False"):
        with scopedckpt.checkpointing():
            scopedckpt.checkpoint(model[0], x, DynamicCache())


def test_layers_that_only_read_the_cache_may_take_it() -> None:
    class Reader(CachingLayer):
        _can_checkpoint_with_cache = True

    layer = Reader()
    with _made(regions=1, recomputes=1), scopedckpt.checkpointing(layer):
        layer(torch.randn(2, 6, requires_grad=True), cache=DynamicCache()).sum().backward()


def test_swapped_identical_layers_are_named_by_their_module_paths() -> None:
    model = nn.Sequential(scopedckpt.Dropout(0.5), scopedckpt.Dropout(0.5))
    calls: list[int] = []

    def swapping(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        first, second = (model[0], model[1]) if len(calls) == 1 else (model[1], model[0])
        return second(first(x))

    x = torch.randn(4, 6, requires_grad=True)
    with scopedckpt.checkpointing(root=model):
        out = scopedckpt.checkpoint(swapping, x)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape(
            "made call #0 as dropout of Dropout(p=0.5, inplace=False) at '1', but the first "
            "forward made call #0 as dropout of Dropout(p=0.5, inplace=False) at '0'."
        ),
    ):
        out.sum().backward()
