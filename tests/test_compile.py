"""torch.compile (CPU, inductor): scoped layers and regions stay exact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import scopedckpt

pytestmark = [
    pytest.mark.slow,
    # Dynamo's own internals warn (deprecations, .grad of non-leaves while tracing).
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return scopedckpt.convert(
        nn.Sequential(
            nn.Linear(8, 8),
            nn.BatchNorm1d(8),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(8, 8),
            nn.BatchNorm1d(8, momentum=None),
            nn.Dropout(0.3),
            nn.Linear(8, 2),
        )
    )


def _train(model: nn.Module, compiled: bool, checkpointed: bool, steps: int = 2) -> tuple:
    model = copy.deepcopy(model)
    run = torch.compile(model) if compiled else model
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    outs, grads = [], []
    for _ in range(steps):
        with scopedckpt.checkpointing(*model.children(), enabled=checkpointed):
            out = run(x)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.extend(p.grad.clone() for p in model.parameters())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return outs, grads, [b.clone() for b in model.buffers()], torch.get_rng_state()


def test_compiled_model_matches_eager_with_and_without_regions() -> None:
    torch._dynamo.reset()
    model = _model()
    eager = _train(model, compiled=False, checkpointed=False)
    for checkpointed in (False, True):
        outs, grads, buffers, rng = _train(model, compiled=True, checkpointed=checkpointed)
        for a, b in zip(outs + grads, eager[0] + eager[1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        for a, b in zip(buffers, eager[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert int(buffers[2]) == 2  # num_batches_tracked: once per step
        assert torch.equal(rng, eager[3])  # same seeds drawn: masks replayed, not redrawn


def test_graph_breaks_are_counted() -> None:
    """The numbers reported in docs/compile.md, kept true by this test."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = scopedckpt.convert(
        nn.Sequential(
            nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 2)
        )
    )
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=counting_backend)(torch.randn(6, 8)).sum().backward()
    assert sum(counters["graph_break"].values()) == 3
    assert len(graphs) == 0  # the breaks sit in Sequential's loop: dynamo runs it eagerly
