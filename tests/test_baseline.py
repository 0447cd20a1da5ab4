"""The problems scopedckpt exists for are real in this torch: keep the comparison honest."""

from __future__ import annotations

import copy

import torch
import torch.utils.checkpoint as tc
from torch import nn

import scopedckpt


def _bn_model(bn: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), bn(4))


def test_torch_checkpoint_updates_batch_norm_twice() -> None:
    model = _bn_model(nn.BatchNorm1d)
    x = torch.randn(6, 4, requires_grad=True)
    tc.checkpoint(model, x, use_reentrant=False).sum().backward()
    assert int(model[1].num_batches_tracked) == 2  # pytorch#96136


def test_scoped_batch_norm_updates_once() -> None:
    plain = _bn_model(scopedckpt.BatchNorm1d)
    checkpointed = copy.deepcopy(plain)
    x = torch.randn(6, 4)
    plain(x).sum().backward()
    with scopedckpt.checkpointing():
        scopedckpt.checkpoint(checkpointed, x.requires_grad_()).sum().backward()
    assert int(checkpointed[1].num_batches_tracked) == 1
    assert torch.equal(checkpointed[1].running_mean, plain[1].running_mean)
    assert torch.equal(checkpointed[1].running_var, plain[1].running_var)


def test_selective_checkpoint_must_save_still_double_counts() -> None:
    """Stock SAC with MUST_SAVE on the batch-norm op does not stop the second update."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        names = ("batch_norm", "native_dropout", "bernoulli")
        if any(name in str(op) for name in names):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    model = _bn_model(nn.BatchNorm1d)
    x = torch.randn(6, 4, requires_grad=True)
    out = tc.checkpoint(
        model,
        x,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(policy),
    )
    out.sum().backward()
    assert int(model[1].num_batches_tracked) == 2


def test_torch_checkpoint_without_rng_stash_gives_wrong_dropout_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)

    def grads(checkpointed: bool) -> torch.Tensor:
        m = copy.deepcopy(model)
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        out = (
            tc.checkpoint(m, xi, use_reentrant=False, preserve_rng_state=False)
            if checkpointed
            else m(xi)
        )
        out.square().sum().backward()
        return xi.grad

    assert not torch.equal(grads(True), grads(False))


def test_scoped_dropout_needs_no_rng_stash() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), scopedckpt.Dropout(0.5))
    x = torch.randn(4, 8)

    def grads(checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        m = copy.deepcopy(model)
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        with scopedckpt.checkpointing(enabled=checkpointed):
            out = scopedckpt.checkpoint(m, xi)
        out.square().sum().backward()
        return xi.grad, torch.get_rng_state()

    (g1, rng1), (g2, rng2) = grads(True), grads(False)
    assert torch.equal(g1, g2)
    assert torch.equal(rng1, rng2)
