"""convert(): in-place swap to scoped layers that keeps everything else."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch import nn

import scopedckpt


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=None),
        nn.Dropout2d(0.2),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.AlphaDropout(0.1),
        nn.Linear(64, 8),
        nn.BatchNorm1d(8, affine=False),
        nn.FeatureAlphaDropout(0.1),
        nn.Sequential(
            nn.Unflatten(1, (2, 4)),
            nn.Dropout1d(0.1),
            nn.Unflatten(2, (2, 2, 1)),
            nn.BatchNorm3d(2),
            nn.Dropout3d(0.1),
        ),
    )


def test_every_torch_layer_is_replaced_keeping_tensors_and_mode() -> None:
    model = _model().double().eval()
    original = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    converted = scopedckpt.convert(model)
    assert converted is model
    for name, module in converted.named_modules():
        torch_type = type(dict(original.named_modules())[name])
        if torch_type.__module__.startswith("torch.nn.modules.") and hasattr(
            scopedckpt, torch_type.__name__
        ):
            assert type(module) is getattr(scopedckpt, torch_type.__name__), name
        assert isinstance(module, torch_type)
        assert module.training is False
    for n, p in converted.named_parameters():
        assert p is params[n]
    for n, b in converted.named_buffers():
        assert b is buffers[n]
        assert b.dtype in (torch.float64, torch.long)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    assert torch.equal(converted(x), original(x))


def test_state_dict_round_trips_strictly_both_ways() -> None:
    original = _model()
    converted = scopedckpt.convert(copy.deepcopy(original))
    converted.load_state_dict(original.state_dict(), strict=True)
    fresh = _model()
    buffer = io.BytesIO()
    torch.save(converted.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer), strict=True)
    whole = io.BytesIO()
    torch.save(converted, whole)
    whole.seek(0)
    loaded = torch.load(whole, weights_only=False)
    assert type(loaded[1]) is scopedckpt.BatchNorm2d


def test_inplace_false_copies_and_root_layers_are_returned() -> None:
    model = _model()
    converted = scopedckpt.convert(model, inplace=False)
    assert converted is not model and type(model[1]) is nn.BatchNorm2d
    layer = scopedckpt.convert(nn.Dropout(0.3))
    assert type(layer) is scopedckpt.Dropout and layer.p == 0.3


def test_already_converted_layers_and_hooks_are_kept() -> None:
    model = scopedckpt.convert(_model())
    first = model[1]
    calls: list[int] = []
    model[4].register_forward_hook(lambda *a: calls.append(1))
    again = scopedckpt.convert(model)
    assert again[1] is first
    again.eval()(torch.randn(2, 3, 4, 4))
    assert calls == [1]


def test_user_subclasses_are_reported_not_replaced() -> None:
    class MyDropout(nn.Dropout):
        pass

    model = nn.Sequential(MyDropout(0.1), nn.Dropout(0.1))
    with pytest.warns(
        scopedckpt.ConvertWarning,
        match=re.escape(
            "scopedckpt: convert left these modules unscoped: 0 (test_user_subclasses_are_"
            "reported_not_replaced.<locals>.MyDropout: a subclass of a torch layer; its forward "
            "may differ from torch's)."
        ),
    ):
        scopedckpt.convert(model)
    assert type(model[0]) is MyDropout and type(model[1]) is scopedckpt.Dropout


def test_attention_dropout_is_reported() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=8, dropout=0.1)
    with pytest.warns(
        scopedckpt.ConvertWarning,
        match=re.escape("self_attn (MultiheadAttention: functional attention dropout, p=0.1)"),
    ):
        scopedckpt.convert(layer)


# Stand-ins named like the ecosystem's layers: convert knows them by class name only.
class DropPath(nn.Module):  # timm.layers.DropPath
    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob


class StochasticDepth(DropPath):  # torchvision.ops.StochasticDepth
    pass


class BertSelfAttention(nn.Module):  # Hugging Face: nn.Dropout read only for its p
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(4, 4)
        self.dropout = nn.Dropout(0.2)


class LlamaAttention(nn.Module):  # Hugging Face: a float rate
    def __init__(self, rate: float) -> None:
        super().__init__()
        self.attention_dropout = rate


class BatchNormAct2d(nn.BatchNorm2d):  # timm: its own forward calling F.batch_norm
    pass


def test_one_warning_names_every_unscoped_random_or_stateful_module() -> None:
    model = nn.Sequential(
        nn.Sequential(DropPath(0.1), StochasticDepth(0.2)),
        BertSelfAttention(),
        LlamaAttention(0.1),
        LlamaAttention(0.0),  # no dropout: nothing to say
        BatchNormAct2d(4),
        nn.InstanceNorm1d(4, track_running_stats=True),
        nn.Dropout(0.3),
    )
    with pytest.warns(scopedckpt.ConvertWarning) as record:
        scopedckpt.convert(model)
    assert len(record) == 1
    message = str(record[0].message)
    for expected in (
        "0.0 (DropPath: drop path)",
        "0.1 (StochasticDepth: stochastic depth)",
        "1 (BertSelfAttention: attention dropout applied functionally, p=0.2)",
        "2 (LlamaAttention: attention dropout applied functionally, p=0.1)",
        "4 (BatchNormAct2d: a subclass of a torch layer",
        "5 (InstanceNorm1d: running statistics)",
    ):
        assert expected in message, expected
    assert "3 (" not in message and "6 (" not in message
    assert type(model[6]) is scopedckpt.Dropout
    assert type(model[1].dropout) is scopedckpt.Dropout  # converted, and still reported


def test_a_model_convert_fully_scopes_gets_no_warning() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scopedckpt.convert(_model())
        scopedckpt.convert(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_non_module_is_rejected() -> None:
    with pytest.raises(
        TypeError, match=re.escape("scopedckpt: convert expected an nn.Module, got list.")
    ):
        scopedckpt.convert([nn.Dropout()])  # type: ignore[arg-type]
