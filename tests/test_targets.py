"""checkpointing(*targets): regions chosen by the caller, with no wrapper modules."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import scopedckpt
from scopedckpt import Phase
from scopedckpt.core._engine import COUNTERS
from scopedckpt.testing import assert_checkpoint_equivalent
from scopedckpt.testing import strategies as sst


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(4, 4), scopedckpt.BatchNorm1d(4), scopedckpt.Dropout(0.3))
            for _ in range(3)
        ]
    )


def test_instance_target_is_a_region_and_leaves_no_trace() -> None:
    model = _mlp()
    names = [n for n, _ in model.named_modules()]
    keys = list(model.state_dict())
    calls: list[str] = []
    model[1].register_forward_hook(lambda m, i, o: calls.append("hook"))
    x = torch.randn(5, 4, requires_grad=True)
    before = COUNTERS.regions
    with scopedckpt.checkpointing(model[1]):
        assert "forward" in vars(model[1])
        assert [n for n, _ in model.named_modules()] == names
        assert list(model.state_dict()) == keys
        out = model(x)
    assert COUNTERS.regions - before == 1
    assert calls == ["hook"]
    # Inert until torch frees the region: a plain call here is not a region.
    model(x)
    assert COUNTERS.regions - before == 1
    out.sum().backward()
    assert int(model[1][1].num_batches_tracked) == 2  # the two forwards, not the recompute
    del out
    assert "forward" not in vars(model[1])


def test_module_list_selects_each_child_and_class_targets_every_instance() -> None:
    blocks = nn.ModuleList(_mlp())
    sequential_forward = vars(nn.Sequential)["forward"]
    x = torch.randn(5, 4, requires_grad=True)
    for targets in ((blocks,), (nn.Sequential,)):
        before = COUNTERS.regions
        with scopedckpt.checkpointing(*targets):
            h = x
            for block in blocks:
                h = block(h)
        assert COUNTERS.regions - before == 3
        h.sum().backward()
        del h
        gc.collect()
        assert vars(nn.Sequential)["forward"] is sequential_forward
        assert all("forward" not in vars(block) for block in blocks)


def test_predicate_targets_need_root_and_select_by_name() -> None:
    model = _mlp()
    before = COUNTERS.regions
    with scopedckpt.checkpointing(lambda name, m: name in ("0", "2"), root=model):
        model(torch.randn(5, 4, requires_grad=True))
    assert COUNTERS.regions - before == 2


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Child(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).relu()


def test_class_target_covers_subclasses_once_and_restores_the_classes() -> None:
    base_forward, child_forward = Base.forward, Child.forward
    x = torch.randn(3, 4, requires_grad=True)
    before = COUNTERS.regions
    with scopedckpt.checkpointing(Base):
        Child()(x).sum().backward()
        Base()(x).sum().backward()
    assert COUNTERS.regions - before == 2  # not 3: super().forward stays inside Child's region
    assert Base.forward is base_forward and Child.forward is child_forward


def test_nested_targets_are_nested_regions_and_exact() -> None:
    model = _mlp()
    outer = nn.Sequential(model)
    assert_checkpoint_equivalent(
        outer, torch.randn(6, 4), targets=[outer, model[0], model[2]], steps=2
    )


def test_keyword_arguments_and_dict_outputs() -> None:
    class KW(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = scopedckpt.Dropout(0.5)
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
            h = self.drop(self.lin(x)) * scale
            return {"h": h, "pair": (h.sum(), h.mean())}  # type: ignore[dict-item]

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kw = KW()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.kw(x, scale=2.0)
            return out["h"] + out["pair"][0]

    torch.manual_seed(0)
    model = Outer()
    assert_checkpoint_equivalent(model, torch.randn(3, 4), targets=[model.kw], steps=2)


def test_other_threads_without_the_scope_make_plain_calls() -> None:
    """One thread checkpoints a module while another calls it plainly, interleaved."""
    inside_calls: list[Phase] = []
    outside_calls: list[Phase] = []

    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls = inside_calls if threading.current_thread().name == "in" else outside_calls
            calls.append(scopedckpt.phase())
            return self.lin(x)

    shared = Recorder()
    barrier = threading.Barrier(2)

    def worker(scoped: bool) -> None:
        for _ in range(20):
            barrier.wait()
            x = torch.randn(2, 4, requires_grad=True)
            with scopedckpt.checkpointing(shared, enabled=scoped):
                shared(x).sum().backward()

    threads = [
        threading.Thread(target=worker, args=(scoped,), name=name)
        for name, scoped in (("in", True), ("out", False))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert inside_calls == [Phase.FORWARD, Phase.RECOMPUTE] * 20
    assert outside_calls == [Phase.NONE] * 20


def _small_transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    # The attention dropout stays functional inside torch: replayed, and reported.
    with pytest.warns(scopedckpt.ConvertWarning, match=r"self_attn \(MultiheadAttention"):
        return scopedckpt.convert(encoder)


def test_converted_transformer_trains_bit_identically() -> None:
    encoder = _small_transformer()
    assert isinstance(encoder.layers[0].dropout1, scopedckpt.Dropout)
    x = torch.randn(3, 5, 16)
    assert_checkpoint_equivalent(encoder, x, targets=[nn.TransformerEncoderLayer], steps=3)
    assert_checkpoint_equivalent(
        encoder, x, targets=[encoder.layers], steps=2, backward="retain_graph"
    )


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Dropout2d(0.1),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.body(x)).relu()


def test_converted_resnet_trains_bit_identically() -> None:
    torch.manual_seed(0)
    net = scopedckpt.convert(
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            ResBlock(8),
            ResBlock(8),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(0.2),
            nn.Linear(8, 10),
        )
    )
    x = torch.randn(4, 3, 8, 8)
    assert_checkpoint_equivalent(net, x, targets=[ResBlock], steps=3)
    assert_checkpoint_equivalent(
        net, x, targets=[net[3], net[4].body], steps=2, backward="grad_then_backward"
    )


@given(data=st.data(), depth=st.integers(1, 4), seed=sst.seeds())
def test_random_target_selections_train_identically(
    data: st.DataObject, depth: int, seed: int
) -> None:
    torch.manual_seed(seed % 1000)
    p = data.draw(st.floats(0.0, 0.9))
    blocks = [
        nn.Sequential(
            nn.Linear(4, 4),
            scopedckpt.BatchNorm1d(4, momentum=data.draw(st.sampled_from([None, 0.1]))),
            nn.ReLU(),
            scopedckpt.Dropout(p),
        )
        for _ in range(depth)
    ]
    model = nn.Sequential(*blocks)
    targets = data.draw(sst.regions(model))
    x = data.draw(sst.batches((4,)))
    assert_checkpoint_equivalent(
        model, x, targets=targets, seed=seed, steps=2, require_regions=False
    )


def test_strict_scope_applies_to_targets() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match="strict mode found the random op"),
        scopedckpt.checkpointing(model, strict=True),
    ):
        model(torch.randn(2, 4, requires_grad=True))
