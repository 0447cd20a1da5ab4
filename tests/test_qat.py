"""Quantization-aware training under checkpointing is plain training, bit for bit.

QAT's modules keep state the buffer guard must cover (NOTE [ buffer guard ]): a
fused fake quant's op updates its observer child's statistics without calling
it and without moving their versions, resizing them at its first call; a fused
``ConvBn2d`` reads ``bn.running_var`` before calling ``bn``; a fake quant reads
its observer's statistics after calling it. The first tests train torch's own
QAT models; the last ones pin each pattern without ``torch.ao``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import scopedckpt

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning"),
]

STEPS = 6


def _quantization() -> object:
    """torch.ao.quantization with what these tests use, else skip."""
    tq = pytest.importorskip("torch.ao.quantization")
    needed = ("QuantStub", "DeQuantStub", "fuse_modules_qat", "prepare_qat")
    needed += ("get_default_qat_qconfig", "default_qat_qconfig", "disable_observer")
    missing = [name for name in needed if not hasattr(tq, name)]
    if missing:
        pytest.skip(f"torch.ao.quantization lacks {', '.join(missing)}")
    return tq


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class ConvModel(nn.Module):
    def __init__(self, tq: object) -> None:
        super().__init__()
        self.quant = tq.QuantStub()  # type: ignore[attr-defined]
        self.b1 = Block()
        self.b2 = Block()
        self.dequant = tq.DeQuantStub()  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.b2(self.b1(self.quant(x))))


class LinearModel(nn.Module):
    def __init__(self, tq: object) -> None:
        super().__init__()
        self.quant = tq.QuantStub()  # type: ignore[attr-defined]
        self.b1 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.b2 = nn.Sequential(nn.Linear(8, 8))
        self.dequant = tq.DeQuantStub()  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.b2(self.b1(self.quant(x))))


def _conv_model(tq: object, qconfig: object) -> nn.Module:
    torch.manual_seed(0)
    model = ConvModel(tq).train()
    model.qconfig = qconfig
    fused = [["b1.conv", "b1.bn", "b1.relu"], ["b2.conv", "b2.bn", "b2.relu"]]
    tq.fuse_modules_qat(model, fused, inplace=True)  # type: ignore[attr-defined]
    tq.prepare_qat(model, inplace=True)  # type: ignore[attr-defined]
    return model


def _linear_model(tq: object, qconfig: object) -> nn.Module:
    torch.manual_seed(0)
    model = LinearModel(tq).train()
    model.qconfig = qconfig
    tq.prepare_qat(model, inplace=True)  # type: ignore[attr-defined]
    return model


def _assert_trains_alike(
    build: Callable[[], nn.Module],
    shape: tuple[int, ...],
    regions: Callable[[nn.Module], list[nn.Module]] = lambda m: [m.b1, m.b2],
    before_step: Callable[[nn.Module, int], None] | None = None,
) -> None:
    """Train ``STEPS`` SGD steps plainly and with the regions checkpointed: the loss of
    every step and every parameter and buffer after it are equal bit for bit."""
    plain, checkpointed = build(), build()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, checkpointed)]
    inputs = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(*shape, generator=inputs)
        losses = []
        for model, optimizer in zip((plain, checkpointed), optimizers):
            if before_step is not None:
                before_step(model, step)
            if model is plain:
                loss = model(x).square().mean()
            else:
                with scopedckpt.checkpointing(*regions(model), root=model):
                    loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step}: the loss differs"
        named = (("parameter", nn.Module.named_parameters), ("buffer", nn.Module.named_buffers))
        for kind, items in named:
            ours = dict(items(checkpointed))
            for name, theirs in items(plain):
                mine = ours[name]
                assert mine.shape == theirs.shape, f"step {step}: {kind} {name}'s shape"
                assert torch.equal(mine, theirs), f"step {step}: {kind} {name} differs"


def _observers_off_at_step_3(model: nn.Module, step: int) -> None:
    """A warm-up switch: the observers stop after three steps, fake quant goes on."""
    if step == 3:
        model.apply(_quantization().disable_observer)  # type: ignore[attr-defined]


@pytest.mark.parametrize("warm_up", [None, _observers_off_at_step_3], ids=["observing", "warm-up"])
def test_fused_conv_bn_relu_qat_trains_as_without_checkpointing(
    warm_up: Callable[[nn.Module, int], None] | None,
) -> None:
    """The fused ConvBnReLU2d's weight fake quant resizes its observer's statistics in its
    op at step 0 (an IndexError in the recompute before the fix) and updates them
    without a version after; the ConvBn folds bn.running_var before calling bn."""
    tq = _quantization()
    qconfig = tq.get_default_qat_qconfig("fbgemm")  # type: ignore[attr-defined]
    _assert_trains_alike(lambda: _conv_model(tq, qconfig), (2, 4, 5, 5), before_step=warm_up)


def test_convert_leaves_the_batch_norms_fused_modules_read_and_says_so() -> None:
    """A fused ConvBnReLU2d reads bn.running_var before calling bn: convert() leaves that
    batch norm torch's (the buffer guard keeps it exact), names it in its warning, and
    the converted model trains as the plain one."""
    tq = _quantization()
    qconfig = tq.get_default_qat_qconfig("fbgemm")  # type: ignore[attr-defined]
    with pytest.warns(scopedckpt.ConvertWarning, match=r"b1\.conv\.bn \(BatchNorm2d: read by"):
        scopedckpt.convert(_conv_model(tq, qconfig))

    def build() -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scopedckpt.ConvertWarning)
            return scopedckpt.convert(_conv_model(tq, qconfig))

    model = build()
    assert type(model.b1.conv.bn) is nn.BatchNorm2d
    _assert_trains_alike(build, (2, 4, 5, 5))


def test_regions_over_the_fused_modules_and_nested_regions_train_alike() -> None:
    """Regions over each fused module (the region's owner holds the fake quants), and
    over a block and its fused module at once."""
    tq = _quantization()
    qconfig = tq.get_default_qat_qconfig("fbgemm")  # type: ignore[attr-defined]
    build = lambda: _conv_model(tq, qconfig)  # noqa: E731
    _assert_trains_alike(build, (2, 4, 5, 5), lambda m: [m.b1.conv, m.b2.conv])
    _assert_trains_alike(build, (2, 4, 5, 5), lambda m: [m.b1, m.b1.conv, m.b2])


@pytest.mark.parametrize("fused", [False, True], ids=["FakeQuantize", "fused"])
def test_linear_per_tensor_qat_trains_as_without_checkpointing(fused: bool) -> None:
    """Per-tensor fake quant of a small Linear model: torch's FakeQuantize calls its
    observer and reads its statistics after the call; the fused one never calls it."""
    tq = _quantization()
    if fused:
        qconfig = tq.get_default_qat_qconfig("fbgemm")  # type: ignore[attr-defined]
    else:
        qconfig = tq.default_qat_qconfig  # type: ignore[attr-defined]
    _assert_trains_alike(
        lambda: _linear_model(tq, qconfig), (3, 8), before_step=_observers_off_at_step_3
    )


# The patterns, without torch.ao.


class Folding(nn.Module):
    """Reads its batch norm's running variance before calling it, as QAT's ConvBn2d."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)
        return self.bn(self.linear(x) * scale)


class Statistic(nn.Module):
    """Holds a running maximum; never called by :class:`WritesItsChild`."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("top", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.top.copy_(torch.maximum(self.top, x.detach().abs().amax(0)))
        return x


class WritesItsChild(nn.Module):
    """Has a buffer of its own, and averages into its child's through ``.data`` (no
    version moves), as a fused fake quant's op updates its observer's."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.stat = Statistic()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.data.add_(1)
        self.stat.top.data.mul_(0.5).add_(x.detach().abs().amax(0), alpha=0.5)  # an average
        return x * (self.stat.top + 1)


class ReadsAfterItsCall(nn.Module):
    """Calls its child, then reads the child's statistic, as FakeQuantize its observer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.stat = Statistic()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.stat(y)
        return y / (self.stat.top + 1)


@pytest.mark.parametrize("layer", [Folding, WritesItsChild, ReadsAfterItsCall])
def test_state_read_or_written_around_its_modules_calls_trains_alike(
    layer: type[nn.Module],
) -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), layer(), nn.Linear(4, 4)).train()

    _assert_trains_alike(build, (3, 4), lambda m: [m[1]])


def test_recomputes_leave_the_real_buffers_in_place() -> None:
    """The recompute runs on copies from its start to its end: afterwards each module
    holds its own buffer objects again, updated once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ReadsAfterItsCall(), WritesItsChild())
    held = {name: b for name, b in model.named_buffers()}
    with scopedckpt.checkpointing(model[1], model[2], root=model):
        model(torch.randn(3, 4)).sum().backward()
    assert {name: b for name, b in model.named_buffers()}.keys() == held.keys()
    for name, b in model.named_buffers():
        assert b is held[name], name
    assert model[2].calls.item() == 1
