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
        UserWarning, match=re.escape("unchanged, since their forward may differ from torch's: 0 (")
    ):
        scopedckpt.convert(model)
    assert type(model[0]) is MyDropout and type(model[1]) is scopedckpt.Dropout


def test_attention_dropout_is_reported() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=8, dropout=0.1)
    with pytest.warns(UserWarning, match=re.escape("self_attn (dropout=0.1)")):
        scopedckpt.convert(layer)


def test_non_module_is_rejected() -> None:
    with pytest.raises(
        TypeError, match=re.escape("scopedckpt: convert expected an nn.Module, got list.")
    ):
        scopedckpt.convert([nn.Dropout()])  # type: ignore[arg-type]
