"""scopedckpt.memory_report(): rows per region, totals against saved_tensors_hooks."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt import Phase
from scopedckpt.core._state import FRAME
from scopedckpt.core._torch_private import top_saved_tensors_hooks
from scopedckpt.mechanisms import _report


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(
            nn.Linear(32, 48), nn.BatchNorm1d(48), nn.GELU(), nn.Dropout(0.2), nn.Linear(48, 32)
        )
        for _ in range(3)
    ]
    return scopedckpt.convert(nn.Sequential(*blocks, nn.Linear(32, 1)))


def _saved_by(block: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """What ``block(x)``'s ops save for backward without checkpointing (saved_tensors_hooks),
    once per storage, leaving out ``x`` and the block's parameters and buffers; and its
    output."""
    seen = {t.untyped_storage().data_ptr() for t in (x, *block.parameters(), *block.buffers())}
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    return total, out


def _storage_bytes_saved_plainly(model: nn.Sequential, x: torch.Tensor) -> int:
    """:func:`_saved_by` summed over the first three blocks, each on the last's output."""
    total, h = 0, x
    for block in list(model)[:3]:
        saved, h = _saved_by(block, h)
        total += saved
    return total


def _transformer() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(32, 4, 64, batch_first=True) for _ in range(3)]
    return scopedckpt.convert(nn.Sequential(*layers, nn.Linear(32, 1)))


@pytest.mark.parametrize(
    ("build", "shape"),
    # The transformer frees temporaries inside each layer, so the allocator
    # hands their addresses to later saved tensors: storages must be told apart.
    [(_model, (16, 32)), (_transformer, (4, 10, 32))],
)
@pytest.mark.filterwarnings("ignore::scopedckpt.ConvertWarning")
def test_freed_bytes_agree_with_a_saved_tensors_hooks_count(
    build: Callable[[], nn.Sequential], shape: tuple[int, ...]
) -> None:
    model = build()
    x = torch.randn(*shape, requires_grad=True)
    expected = _storage_bytes_saved_plainly(model, x)
    with scopedckpt.memory_report(root=model) as report:
        with scopedckpt.checkpointing(*list(model)[:3]):
            loss = model(x).sum()
        loss.backward()
    assert expected > 0
    assert report.totals["freed_bytes"] == expected


@pytest.mark.usefixtures("no_sampling")  # a verified forward keeps its saved tensors
def test_a_storage_at_a_freed_storages_address_counts_as_freed_again() -> None:
    # Two storages over one Python buffer share an address without the allocator's help:
    # the second, saved after the first is freed, is a new saved tensor.
    buffer = bytearray(4 * 64)
    nbytes = len(buffer)

    def region(x: torch.Tensor) -> torch.Tensor:
        first = torch.frombuffer(buffer, dtype=torch.float32)
        y = x * first  # saves `first`
        key = first.untyped_storage().data_ptr()
        del first  # freed: the region's saved tensors are not kept
        second = torch.frombuffer(buffer, dtype=torch.float32)
        assert second.untyped_storage().data_ptr() == key
        return y * second  # saves `second`, at the freed storage's address

    x = torch.randn(64, requires_grad=True)
    with scopedckpt.memory_report() as report:
        with scopedckpt.checkpointing():
            loss = scopedckpt.checkpoint(region, x).sum()
        loss.backward()
    assert report.totals["freed_bytes"] == 2 * nbytes


@pytest.mark.usefixtures("no_sampling")  # no verified column
def test_rows_count_calls_recomputes_and_what_the_region_keeps() -> None:
    model = _model()
    x = torch.randn(16, 32, requires_grad=True)
    with scopedckpt.memory_report(root=model) as report:
        for _ in range(2):
            with scopedckpt.checkpointing(*list(model)[:3]):
                loss = model(x).sum()
            loss.backward(retain_graph=True)
            loss.backward()
    rows = report.rows
    assert [row["region"] for row in rows] == ["0", "1", "2"]
    stash = torch.get_rng_state().nbytes  # the RNG replay's copy of the CPU generator
    for row in rows:
        assert row["calls"] == 2
        assert row["recomputes"] == 4  # two backward passes per step
        assert row["kept_bytes"] == 2 * (16 * 32 * 4 + stash)  # the input and the stash
        assert row["records"] == 4  # a batch norm and a dropout record per call
        assert row["recompute_seconds"] > 0
    json.dumps(rows)  # serialisable as it is
    text = str(report)
    assert text.splitlines()[0].split() == [
        "region",
        "calls",
        "recomputes",
        "kept",
        "freed",
        "records",
        "recompute",
    ]
    assert text.splitlines()[-1].startswith("total")


def test_a_channel_dropout_region_keeps_its_inputs_and_the_rng_stash_alone() -> None:
    """A region with Dropout2d keeps what torch's checkpoint keeps (its input, the
    generators' states), not its channel noise: the recompute rebuilds it from the seed,
    and the noise its first forward saved for backward counts as freed."""
    torch.manual_seed(0)
    block = scopedckpt.convert(nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Dropout2d(0.3)))
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    with scopedckpt.memory_report(root=block) as report:
        with scopedckpt.checkpointing(block):
            loss = block(x).sum()
        loss.backward()
    (row,) = report.rows
    stash = torch.get_rng_state().nbytes
    assert row["kept_bytes"] == x.nbytes + stash
    plain, _ = _saved_by(block, x)
    assert row["freed_bytes"] == plain


def test_function_regions_are_named_by_the_function_and_nested_regions_get_rows() -> None:
    inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def outer_fn(x: torch.Tensor) -> torch.Tensor:
        return scopedckpt.checkpoint(inner, x.sin()).cos()

    x = torch.randn(4, 8, requires_grad=True)
    with scopedckpt.memory_report() as report:
        with scopedckpt.checkpointing():
            y = scopedckpt.checkpoint(outer_fn, x)
        y.sum().backward()
    rows = {row["region"]: row for row in report.rows}
    assert set(rows) == {
        "test_function_regions_are_named_by_the_function_and_nested_regions_get_rows."
        "<locals>.outer_fn",
        "Sequential",
    }
    # The nested region runs in its parent's recompute (and its own is not needed).
    assert rows["Sequential"]["recomputes"] >= 1


def test_no_report_no_cost_and_nothing_left_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A region started with no report open gets no stats (NOTE [ memory report ]): its
    saved tensors go to torch's pack hook without our counting one, and neither its forward
    nor its recompute, even one run while a report is open, calls the report's code."""
    calls: list[str] = []

    def spy(name: str) -> Callable[..., object]:
        real = getattr(_report, name)

        def call(*args: object) -> object:
            calls.append(name)
            return real(*args)

        return call

    for name in ("counting_saved_tensors", "finish_forward", "recomputed", "now"):
        monkeypatch.setattr(_report, name, spy(name))  # what a measured region calls
    seen: list[tuple[Phase, object, str]] = []

    def body(t: torch.Tensor) -> torch.Tensor:
        frame = FRAME.get()
        hooks = top_saved_tensors_hooks()
        assert frame is not None and hooks is not None
        seen.append((frame.phase, frame.tape.stats, hooks[0].__name__))
        return t.sin()

    x = torch.randn(4, 8, requires_grad=True)
    with scopedckpt.checkpointing():
        y = scopedckpt.checkpoint(body, x)
    with scopedckpt.memory_report() as report:
        y.sum().backward()  # a recompute under a report, of a region started without one
    assert [(phase, stats) for phase, stats, _ in seen] == [
        (Phase.FORWARD, None),
        (Phase.RECOMPUTE, None),
    ]
    assert seen[0][2] != "counting_pack"  # torch's own pack hook, not wrapped
    assert calls == []
    assert report.rows == []
    assert "no checkpoint region ran" in str(report)
    assert not _report._ACTIVE
    # What the probes see when a report is open at the region's start: they can tell.
    seen.clear()
    with scopedckpt.memory_report() as report:
        with scopedckpt.checkpointing():
            y = scopedckpt.checkpoint(body, x)
        y.sum().backward()
    assert [type(stats) for _, stats, _ in seen] == [_report.RegionStats] * 2
    assert seen[0][2] == "counting_pack"
    assert sorted(calls) == ["counting_saved_tensors", "finish_forward", "now", "now", "recomputed"]
    assert [row["recomputes"] for row in report.rows] == [1]
    assert not _report._ACTIVE


def test_checkpointing_is_unchanged_under_a_report() -> None:
    def train(reported: bool) -> list[torch.Tensor]:
        model = _model()
        x = torch.randn(16, 32, requires_grad=True)
        torch.manual_seed(3)
        with scopedckpt.memory_report() if reported else contextlib.nullcontext():
            with scopedckpt.checkpointing(*list(model)[:3]):
                loss = model(x).square().sum()
            loss.backward()
        return [loss.detach(), x.grad, *(p.grad for p in model.parameters()), *model.buffers()]

    for a, b in zip(train(True), train(False)):
        assert torch.equal(a, b)


def test_weights_saved_in_a_function_region_are_not_counted_as_freed() -> None:
    weight = nn.Parameter(torch.randn(8, 8))

    def layer(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(t, weight).relu()  # saves weight.t(): a view

    x = torch.randn(4, 8, requires_grad=True)
    with scopedckpt.memory_report() as report:
        with scopedckpt.checkpointing():
            y = scopedckpt.checkpoint(layer, x)
        y.sum().backward()
    assert report.totals["freed_bytes"] == 4 * 8 * 4  # relu's output only
