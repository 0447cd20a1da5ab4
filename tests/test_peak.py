"""``scopedckpt.peak_report()``: the peak's attribution (NOTE [ peak attribution ] in
``scopedckpt/planner/_peak.py``), its picture, the out-of-memory error that explains itself,
and that reporting never changes a bit of training."""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import scopedckpt


class Block(nn.Module):
    """Linear, BatchNorm, ReLU, Dropout and a residual: what regions must replay exactly."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.bn(self.lin(x)))) + x


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _training_step(model: Net, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    with scopedckpt.checkpointing(model.blocks):
        loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _model_and_optimizer() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = scopedckpt.convert(Net())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def test_categories_sum_to_the_peak_which_is_measure_peaks() -> None:
    """On two steps (the first creates the optimizer's state), each of two equal models."""
    model, optimizer = _model_and_optimizer()
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.Adam(twin.parameters(), lr=1e-2)
    x = torch.randn(64, 32)
    for _ in range(2):
        torch.manual_seed(1)
        report = scopedckpt.peak_report(
            _training_step, model, optimizer, x, root=model, optimizer=optimizer
        )
        torch.manual_seed(1)
        measured = scopedckpt.measure_peak(_training_step, twin, twin_optimizer, x)
        assert report.peak == measured
        assert sum(report.live.values()) == report.peak
        assert max(report.timeline) == report.peak == report.timeline[report.op_index]
        assert list(report.live.values()) == sorted(report.live.values(), reverse=True)
    assert report.resting["parameters and buffers"] == sum(
        t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]
    )
    assert "optimizer state" in report.resting  # made by the first step: resting in the second


def test_optimizer_state_made_in_the_step_is_its_own_category() -> None:
    model, optimizer = _model_and_optimizer()
    x = torch.randn(8, 32)

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()  # Adam's state is made here; the gradients stay alive

    report = scopedckpt.peak_report(step, root=model, optimizer=optimizer)
    # Adam's moments; its "step" counters are made by torch.tensor(), which runs no op: not
    # in the unit (NOTE [ live bytes ]).
    moments = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    state = sum(t.untyped_storage().nbytes() for t in moments)
    assert report.phase == "optimizer step"
    assert report.live["optimizer state"] == state
    assert report.live["gradients"] == sum(p.numel() * 4 for p in model.parameters())


class HugeTemporary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.repeat(512, 1).sum()  # 512 copies of x, freed at once
        return self.lin(x) * scale


def test_a_huge_temporary_in_the_forward_is_the_peak_in_the_forward() -> None:
    model = HugeTemporary()
    x = torch.randn(32, 16)
    report = scopedckpt.peak_report(lambda: model(x).sum().backward(), root=model)
    line = inspect.getsourcelines(HugeTemporary.forward)[1] + 1
    assert (report.phase, report.region, report.where) == (
        "forward",
        None,
        "forward outside regions",
    )
    assert report.op == "aten.sum.default"  # the first op after repeat's: x's copies still live
    assert report.source.startswith(f"{__file__}:{line} (in forward)")
    assert report.live["forward outside regions"] >= 512 * 32 * 16 * 4
    assert report.peak == sum(report.live.values())


class RecomputeTemporary(nn.Module):
    def __init__(self, width: int, copies: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.copies = copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        scale = h.repeat(self.copies, 1).mean()  # a temporary, made again in the recompute
        return torch.tanh(h * scale)  # tanh saves its output: the recompute reaches it


class Wide(nn.Module):
    """Two regions, the second with a large temporary, then a head whose gradients live
    while the regions are recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RecomputeTemporary(64, copies) for copies in (1, 64))
        self.head = nn.Linear(64, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _wide_step(model: Wide, x: torch.Tensor) -> None:
    with scopedckpt.checkpointing(model.blocks):
        loss = model(x).mean()
    loss.backward()


def test_a_temporary_of_a_recompute_is_the_peak_in_that_recompute() -> None:
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(16, 64)
    twin = copy.deepcopy(model)  # its first call is verified too: the same peak
    report = scopedckpt.peak_report(_wide_step, model, x, root=model)
    line = inspect.getsourcelines(RecomputeTemporary.forward)[1] + 2
    assert (report.phase, report.region) == ("recompute", "blocks.1")
    assert report.where == "recompute of region blocks.1"
    assert report.source.startswith(f"{__file__}:{line} (in forward)")
    assert report.live["recompute of region blocks.1"] >= 64 * 16 * 64 * 4
    assert report.live["gradients"] >= 4096 * 65 * 4  # the head's, made before the recompute
    assert ("recompute", "blocks.0") in [stretch[1:] for stretch in report.phases]
    assert report.peak == scopedckpt.measure_peak(_wide_step, twin, x)


def test_regions_without_a_root_are_named_as_errors_name_them() -> None:
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(16, 64)
    report = scopedckpt.peak_report(_wide_step, model, x)
    assert report.phase == "recompute"
    assert (
        report.region
        == "region '1' in the ModuleList given to checkpointing() (RecomputeTemporary)"
    )
    assert report.where == f"recompute of {report.region}"
    assert "gradients" not in report.live  # told apart only for root's or optimizer's


def test_gradients_that_dominate_are_the_largest_category() -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    x = torch.randn(2, 1024)
    report = scopedckpt.peak_report(lambda: model(x).sum().backward(), root=model)
    assert report.phase == "backward"
    assert next(iter(report.live)) == "gradients"
    assert report.live["gradients"] >= 2 * 1024 * 1024 * 4


def test_gradients_a_step_assigns_itself_are_gradients() -> None:
    """Made by ``torch.autograd.grad`` and assigned to ``.grad`` (no accumulation hook
    runs): still the gradients, found on the parameters when the step ends."""
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    x = torch.randn(2, 1024)

    def step() -> None:
        grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
        for p, g in zip(model.parameters(), grads):
            p.grad = g

    report = scopedckpt.peak_report(step, root=model)
    assert report.live["gradients"] >= 2 * 1024 * 1024 * 4


def test_out_of_memory_names_the_region_in_flight_and_keeps_the_original() -> None:
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(16, 64)
    twin = copy.deepcopy(model)
    peak = scopedckpt.peak_report(_wide_step, model, x, root=model).peak
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"^scopedckpt: out of memory in the recompute of region blocks\.1, at aten\.",
    ) as raised:
        scopedckpt.peak_report(_wide_step, twin, x, root=twin, limit=peak - 1)
    message = str(raised.value)
    assert "live when it failed" in message and "recompute of region blocks.1" in message
    assert f"{__file__}:" in message.splitlines()[0]
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    assert "simulated out of memory" in str(raised.value.__cause__)


def test_out_of_memory_in_a_regions_forward_names_that_region() -> None:
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(16, 64)
    with pytest.raises(torch.OutOfMemoryError, match=r"in the forward of region blocks\.0, at"):
        scopedckpt.peak_report(_wide_step, model, x, root=model, limit=16 * 64 * 4)
    assert scopedckpt.phase() is scopedckpt.Phase.NONE  # the region was left


def test_to_dict_is_json_and_save_html_writes_an_offline_svg_page(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(16, 64)
    report = scopedckpt.peak_report(_wide_step, model, x, root=model)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["peak"] == report.peak and data["region"] == "blocks.1"
    assert data["ops"] == len(report.timeline) and data["live"] == report.live
    path = tmp_path / "peak.html"
    report.save_html(path)
    html = path.read_text()
    assert "<svg" in html and "</svg>" in html and "recompute of blocks.1" in html
    assert "<script" not in html and "http" not in html and "src=" not in html
    assert str(report).splitlines()[0] in html


def test_the_table_names_the_moment_and_totals_the_peak() -> None:
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(16, 64)
    text = str(scopedckpt.peak_report(_wide_step, model, x, root=model))
    lines = text.splitlines()
    assert lines[0].startswith("peak ") and lines[0].endswith("in the recompute of region blocks.1")
    assert lines[3].split() == ["live", "at", "the", "peak", "bytes", "share"]
    assert lines[-2].startswith("total") and lines[-2].endswith("100%")
    assert lines[-1].startswith("not counted (resting before the step): parameters and buffers")


def test_training_under_peak_report_is_bitwise_training_without_it() -> None:
    plain, plain_optimizer = _model_and_optimizer()
    reported = copy.deepcopy(plain)
    reported_optimizer = torch.optim.Adam(reported.parameters(), lr=1e-2)
    torch.manual_seed(2)
    batches = [torch.randn(64, 32) for _ in range(6)]
    torch.manual_seed(3)
    for x in batches:
        _training_step(plain, plain_optimizer, x)
    torch.manual_seed(3)
    for x in batches:
        scopedckpt.peak_report(
            _training_step,
            reported,
            reported_optimizer,
            x,
            root=reported,
            optimizer=reported_optimizer,
        )
    for (name, a), b in zip(plain.state_dict().items(), reported.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(plain.parameters(), reported.parameters()):
        assert torch.equal(a, b)
    assert plain.blocks[0].bn.num_batches_tracked.item() == 6


def test_reporting_leaves_no_hook_on_the_parameters_or_the_optimizer() -> None:
    model, optimizer = _model_and_optimizer()
    scopedckpt.peak_report(
        _training_step, model, optimizer, torch.randn(8, 32), root=model, optimizer=optimizer
    )
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_bad_arguments_say_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"^scopedckpt: peak_report\(\) takes the step to run"):
        scopedckpt.peak_report(nn.Linear(2, 2)(torch.ones(2)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^scopedckpt: peak_report\(limit=-1\) takes bytes"):
        scopedckpt.peak_report(lambda: None, limit=-1)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def categories_sum_to_measure_peak(
    model: nn.Module,
    twin: nn.Module,
    step: Callable[..., None],
    *inputs: torch.Tensor,
    optimizer_for: Callable[[nn.Module], torch.optim.Optimizer] = _adamw,
) -> list[scopedckpt.PeakReport]:
    """Three steps of ``step(model, optimizer, *inputs)`` under ``peak_report`` beside the
    same steps of ``twin`` under ``measure_peak``: each report's categories sum to its
    peak, which is the twin's measured one, and the two models train bit for bit alike."""
    optimizer, twin_optimizer = optimizer_for(model), optimizer_for(twin)
    reports = []
    for seed in range(3):  # the first makes AdamW's state, which the others find resting
        torch.manual_seed(seed)
        report = scopedckpt.peak_report(
            step, model, optimizer, *inputs, root=model, optimizer=optimizer
        )
        torch.manual_seed(seed)
        assert report.peak == scopedckpt.measure_peak(step, twin, twin_optimizer, *inputs)
        assert sum(report.live.values()) == report.peak
        assert report.timeline[report.op_index] == report.peak
        reports.append(report)
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b)
    return reports


def test_on_the_benchmark_transformer_the_categories_sum_to_the_measured_peak() -> None:
    """The benchmarks' transformer (``nn.TransformerEncoderLayer`` blocks with dropout, each
    a region): the peak is in a region's recompute or the backward, never unattributed."""
    from benchmarks import models

    torch.manual_seed(0)
    model, x = models.transformer(3)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
        with scopedckpt.checkpointing(model.blocks):
            loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    reports = categories_sum_to_measure_peak(model, copy.deepcopy(model), step, x)
    for report in reports:  # the peak is in the backward, made mostly of a recompute's
        assert report.phase in ("backward", "recompute")
        assert next(iter(report.live)).startswith("recompute of region blocks.")
    assert "optimizer state" in reports[-1].resting
