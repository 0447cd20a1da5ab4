"""Two threads train two models at once, one checkpointed, one not: both exact."""

from __future__ import annotations

import threading

import torch
from torch import nn

import scopedckpt
from scopedckpt.testing import _Snapshot


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6),
        scopedckpt.BatchNorm1d(6),
        scopedckpt.Dropout(0.4),
        nn.Linear(6, 6),
        scopedckpt.BatchNorm1d(6),
        scopedckpt.Dropout(0.4),
    )


def _train(
    model: nn.Module,
    checkpointed: bool,
    generator: torch.Generator,
    barrier: threading.Barrier | None,
) -> _Snapshot:
    for m in model.modules():
        if isinstance(m, scopedckpt.Dropout):
            m.generator = generator  # per-thread seeds: the global stream is shared
    snap = _Snapshot()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    for step in range(5):
        if barrier is not None:
            barrier.wait()
        with scopedckpt.checkpointing(model[:3], model[3:], enabled=checkpointed):
            loss = model(x).square().sum()
        loss.backward()
        for name, p in model.named_parameters():
            snap.add(f"{step} {name}", p.grad)
            p.grad = None
        for name, b in model.named_buffers():
            snap.add(f"{step} {name}", b)
    return snap


def test_concurrent_training_in_and_out_of_scope_is_exact() -> None:
    from scopedckpt.testing import _compare

    expected = _train(_model(), False, torch.Generator().manual_seed(1), None)
    barrier = threading.Barrier(2)
    results: dict[bool, _Snapshot] = {}
    models = {True: _model(), False: _model()}  # built here: the global RNG is shared

    def run(checkpointed: bool) -> None:
        generator = torch.Generator().manual_seed(1)
        results[checkpointed] = _train(models[checkpointed], checkpointed, generator, barrier)

    threads = [threading.Thread(target=run, args=(c,)) for c in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _compare(results[True], expected)
    _compare(results[False], expected)
