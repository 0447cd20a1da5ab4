"""DDP on CPU with gloo (2 processes on loopback): regions stay exact."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import scopedckpt

pytestmark = pytest.mark.slow

STEPS = 3
WORLD = 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return scopedckpt.convert(
        nn.Sequential(
            nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3)),
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Dropout(0.3)),
            nn.Linear(8, 2),
        )
    )


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank: int, checkpointed: bool, find_unused: bool) -> dict[str, object]:
    model = DDP(_model(), find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)  # each rank its own dropout masks
        opt.zero_grad()
        with scopedckpt.checkpointing(*model.module[:2], enabled=checkpointed):
            loss = model(_batch(step, rank)).square().mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.module.buffers()],
    }


def _init(rank: int, out: str, name: str) -> None:
    """Join the test's process group through a file store in its temporary folder: no TCP
    port to pick (a port found free can be taken again before the store binds it)."""
    store = Path(out) / f"{name}.store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _worker(rank: int, out: str) -> None:
    _init(rank, out, "ddp")
    torch.set_num_threads(1)
    try:
        results = {
            (ckpt, unused): _train(rank, ckpt, unused)
            for ckpt in (False, True)
            for unused in (False, True)
        }
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _reference() -> dict[str, object]:
    """One process sees every rank's data: gradients are the mean of per-rank gradients."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        total = [torch.zeros_like(p) for p in model.parameters()]
        state = copy.deepcopy(model.state_dict())
        for rank in range(WORLD):
            model.load_state_dict(state)  # each rank starts the step from the same buffers
            torch.manual_seed(1000 * step + rank)
            model(_batch(step, rank)).square().mean().backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad / WORLD
                p.grad = None
            if rank == 0:
                rank0_buffers = copy.deepcopy(model.state_dict())
        model.load_state_dict(rank0_buffers)  # DDP broadcasts rank 0's buffers
        for p, g in zip(model.parameters(), total):
            p.grad = g
        grads.append([g.clone() for g in total])
        opt.step()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()]}


def test_ddp_regions_are_exact_and_match_the_single_process_reference(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    reference = _reference()
    for unused in (False, True):
        plain, ckpt = ranks[0][(False, unused)], ranks[0][(True, unused)]
        for key in ("grads", "params", "buffers"):
            flat_a = torch.cat([t.flatten().double() for t in _flatten(plain[key])])
            flat_b = torch.cat([t.flatten().double() for t in _flatten(ckpt[key])])
            assert torch.equal(flat_a, flat_b), key  # checkpointed == plain DDP, bitwise
            other = torch.cat(
                [t.flatten().double() for t in _flatten(ranks[1][(True, unused)][key])]
            )
            if key != "buffers":
                assert torch.equal(flat_b, other), key  # ranks agree bitwise
        assert int(ckpt["buffers"][2]) == STEPS  # num_batches_tracked: once per step
        for a, b in zip(_flatten(ckpt["grads"]), _flatten(reference["grads"])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(ckpt["params"], reference["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _flatten(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _flatten(item)]  # type: ignore[attr-defined]


def test_sync_batch_norm_still_refuses_cpu() -> None:
    """docs/distributed.md says SyncBatchNorm cannot sync on CPU; fail when torch changes that.

    A one-process gloo group on an in-memory store: SyncBatchNorm syncs only inside a
    process group, and refuses CPU input there."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="expected input tensor to be on GPU"):
            nn.SyncBatchNorm(4).train()(torch.randn(3, 4))
    finally:
        dist.destroy_process_group()


def _fsdp_train(rank: int, checkpointed: bool) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: list[torch.Tensor] = []
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)
        opt.zero_grad()
        with scopedckpt.checkpointing(*model[:2], enabled=checkpointed):
            loss = model(_batch(step, rank)).square().mean()
        loss.backward()
        out.extend(p.grad.to_local().clone() for p in model.parameters())
        opt.step()
    out.extend(p.detach().to_local().clone() for p in model.parameters())
    out.extend(b.clone() for b in model.buffers())
    return out


def _fsdp_worker(rank: int, out: str) -> None:
    _init(rank, out, "fsdp")
    torch.set_num_threads(1)
    try:
        results = {ckpt: _fsdp_train(rank, ckpt) for ckpt in (False, True)}
        torch.save(results, Path(out) / f"fsdp{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_fully_shard_regions_are_exact(tmp_path: Path) -> None:
    """FSDP2 runs on CPU with gloo in this torch: sharded grads, params, buffers match."""
    mp.spawn(_fsdp_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"fsdp{rank}.pt", weights_only=False)
        assert len(results[True]) == len(results[False])
        for a, b in zip(results[True], results[False]):
            assert torch.equal(a, b)
        assert int(results[True][-4]) == STEPS  # first BatchNorm's num_batches_tracked
