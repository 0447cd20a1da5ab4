"""Third-party model families for tests/test_real_models.py: tiny, built from configs.

Each builder returns a :class:`Built`: the model, its inputs, the per-layer blocks to
make regions and a loss. Builders call :func:`pytest.skip` when their package is
missing. Nothing is downloaded (``HF_HUB_OFFLINE=1``). timm imports torchvision at
import time (``timm/layers/create_norm.py``, ``timm/layers/norm_act.py``,
``timm/data/transforms.py``) although none of the models here use it; where torchvision
cannot be imported (not installed, or a CUDA build next to a CPU torch) :func:`_timm`
imports timm with a stand-in torchvision that exists only during that import (see
:func:`_import_timm_without_torchvision`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import scopedckpt

# Models come from configs only; never reach the Hugging Face Hub. Set before
# transformers or huggingface_hub is imported: both read it at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REAL_EXTRA = "pip install -e '.[real]'"


# --------------------------------------------------------------------------- imports


def _forget(package: str) -> None:
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


def _transformers() -> Any:
    return pytest.importorskip("transformers", reason=f"needs transformers ({REAL_EXTRA})")


def _torchvision() -> Any:
    """torchvision, or a skip: here its wheel may be a CUDA build that fails to import."""
    try:
        import torchvision
    except Exception as error:  # ImportError, or RuntimeError from a CUDA build's ops
        _forget("torchvision")
        pytest.skip(f"torchvision does not import here: {type(error).__name__}: {error}")
    return torchvision


class _Placeholder:
    """Any torchvision attribute timm touches while importing: a value, a base, a call."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)  # class MaybeToTensor(transforms.ToTensor) in timm/data


class _FrozenBatchNorm2d(nn.Module):
    """Stands for torchvision.ops.misc.FrozenBatchNorm2d in timm's isinstance checks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision is not installed: FrozenBatchNorm2d is unavailable")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any = _FrozenBatchNorm2d if name == "FrozenBatchNorm2d" else _Placeholder()
        setattr(self, name, value)
        return value


class _StandInTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def _import_timm_without_torchvision() -> None:
    """Import timm with a stand-in torchvision that is gone again afterwards.

    timm 1.0.31 imports torchvision.ops.misc.FrozenBatchNorm2d (layers) and
    torchvision.transforms (timm.data, imported by timm.models) at import time; the
    models used here never call into torchvision. The stand-in lives in sys.modules
    only during ``import timm``, so ``import torchvision`` still fails afterwards.
    """
    _forget("torchvision")
    _forget("timm")
    finder = _StandInTorchvision()
    sys.meta_path.insert(0, finder)
    try:
        import timm  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        _forget("torchvision")


def _timm() -> Any:
    if importlib.util.find_spec("timm") is None:
        pytest.skip(f"needs timm ({REAL_EXTRA}; then pip install --no-deps timm==1.0.31)")
    if "timm" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except Exception:
            try:
                _import_timm_without_torchvision()
            except ImportError as error:  # e.g. Pillow missing: timm.data imports PIL
                _forget("timm")
                pytest.skip(f"timm does not import: {error}")
    return pytest.importorskip("timm", reason=f"needs timm ({REAL_EXTRA})")


# -------------------------------------------------------------------------- families


@dataclass
class Built:
    model: nn.Module
    inputs: tuple[Tensor, ...]
    targets: list[nn.Module]
    loss_fn: Callable[[Any], Tensor]


def _seeded(seed: int = 0) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


def _cross_entropy(labels: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda logits: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _images(gen: torch.Generator, batch: int, size: int) -> Tensor:
    return torch.randn(batch, 3, size, size, generator=gen)


class _HFEncoder(nn.Module):
    """BERT: (input_ids, attention_mask) -> last hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state


class _HFCausalLM(nn.Module):
    """GPT-2: input_ids -> logits; ``use_cache`` fixed at construction."""

    def __init__(self, model: nn.Module, use_cache: bool) -> None:
        super().__init__()
        self.model = model
        self.use_cache = use_cache

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=self.use_cache).logits


class _HFImageClassifier(nn.Module):
    """ViT: pixel_values -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.model(pixel_values=pixel_values).logits


def _checked_attention(model: nn.Module, attn: str) -> None:
    actual = model.config._attn_implementation
    assert actual == attn, f"asked for attn_implementation={attn!r}, the model uses {actual!r}"


def hf_bert(attn: str) -> Built:
    transformers = _transformers()
    gen = _seeded()
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        attn_implementation=attn,
    )
    bert = transformers.BertModel(config, add_pooling_layer=False)
    _checked_attention(bert, attn)
    ids = torch.randint(1, 64, (2, 8), generator=gen)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0  # padding, so the attention mask is not trivial
    model = _HFEncoder(bert)
    return Built(model, (ids, mask), list(bert.encoder.layer), lambda h: h.square().mean())


def hf_gpt2(attn: str, use_cache: bool = False) -> Built:
    transformers = _transformers()
    gen = _seeded()
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=use_cache,
        attn_implementation=attn,
    )
    lm = transformers.GPT2LMHeadModel(config)
    _checked_attention(lm, attn)
    ids = torch.randint(0, 64, (2, 8), generator=gen)

    def next_token_loss(logits: Tensor) -> Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))

    model = _HFCausalLM(lm, use_cache)
    return Built(model, (ids,), list(lm.transformer.h), next_token_loss)


def hf_vit(attn: str) -> Built:
    transformers = _transformers()
    gen = _seeded()
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=4,
        attn_implementation=attn,
    )
    vit = transformers.ViTForImageClassification(config)
    _checked_attention(vit, attn)
    labels = torch.randint(0, 4, (2,), generator=gen)
    model = _HFImageClassifier(vit)
    return Built(model, (_images(gen, 2, 16),), list(vit.vit.layers), _cross_entropy(labels))


def timm_vit(fused: bool) -> Built:
    timm = _timm()
    gen = _seeded()
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        embed_dim=32,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
        num_classes=4,
        drop_rate=0.1,
        proj_drop_rate=0.1,
        attn_drop_rate=0.1,
        drop_path_rate=0.3,
    )
    for block in model.blocks:
        block.attn.fused_attn = fused  # F.scaled_dot_product_attention(dropout_p) or attn_drop
    labels = torch.randint(0, 4, (2,), generator=gen)
    return Built(model, (_images(gen, 2, 16),), list(model.blocks), _cross_entropy(labels))


def timm_resnet() -> Built:
    timm = _timm()
    gen = _seeded()
    # DropPath on every block but the first, DropBlock2d in layer3 and layer4.
    model = timm.create_model(
        "test_resnet",
        pretrained=False,
        num_classes=4,
        drop_rate=0.1,
        drop_path_rate=0.3,
        drop_block_rate=0.3,
    )
    blocks = [
        b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer
    ]
    labels = torch.randint(0, 4, (4,), generator=gen)
    return Built(model, (_images(gen, 4, 32),), blocks, _cross_entropy(labels))


def timm_efficientnet() -> Built:
    timm = _timm()
    gen = _seeded()
    # Every norm is timm.layers.BatchNormAct2d (a BatchNorm2d subclass with its own forward).
    model = timm.create_model(
        "test_efficientnet", pretrained=False, num_classes=4, drop_rate=0.1, drop_path_rate=0.3
    )
    assert any(type(m).__name__ == "BatchNormAct2d" for m in model.modules())
    blocks = [b for stage in model.blocks for b in stage]
    labels = torch.randint(0, 4, (4,), generator=gen)
    return Built(model, (_images(gen, 4, 32),), blocks, _cross_entropy(labels))


def stochastic_depth(x: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """torchvision.ops.stochastic_depth (torchvision/ops/stochastic_depth.py, 0.28)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ["batch", "row"]:
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return x
    survival_rate = 1.0 - p
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return x * noise


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        return stochastic_depth(x, self.p, self.mode, self.training)


class _Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: Tensor) -> Tensor:
        return x.permute(*self.dims)


class CNBlock(nn.Module):
    """torchvision.models.convnext.CNBlock."""

    def __init__(self, dim: int, layer_scale: float, sd_prob: float) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim),
            _Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Linear(4 * dim, dim),
            _Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, x: Tensor) -> Tensor:
        result = self.stochastic_depth(self.layer_scale * self.block(x))
        result += x
        return result


class MBConv(nn.Module):
    """torchvision.models.efficientnet.MBConv (expand, depthwise, SE, project)."""

    def __init__(self, dim: int, expand: int, sd_prob: float) -> None:
        super().__init__()
        hidden, squeeze = dim * expand, max(1, dim // 4)
        self.block = nn.Sequential(
            nn.Conv2d(dim, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.SiLU(),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.SiLU(),
        )
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(hidden, squeeze, 1),
            nn.SiLU(),
            nn.Conv2d(squeeze, hidden, 1),
            nn.Sigmoid(),
        )
        self.project = nn.Sequential(nn.Conv2d(hidden, dim, 1, bias=False), nn.BatchNorm2d(dim))
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, x: Tensor) -> Tensor:
        h = self.block(x)
        result = self.stochastic_depth(self.project(h * self.se(h)))
        result += x
        return result


def torchvision_replica(kind: str) -> Built:
    gen = _seeded()
    dim = 16
    blocks: list[nn.Module] = (
        [CNBlock(dim, layer_scale=0.5, sd_prob=0.3) for _ in range(2)]
        if kind == "convnext"
        else [MBConv(dim, expand=2, sd_prob=0.3) for _ in range(2)]
    )
    model = nn.Sequential(
        nn.Conv2d(3, dim, 3, padding=1),
        *blocks,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(dim, 4),
    )
    labels = torch.randint(0, 4, (4,), generator=gen)
    return Built(model, (_images(gen, 4, 8),), blocks, _cross_entropy(labels))


def torchvision_model(kind: str) -> Built:
    tv = _torchvision()
    gen = _seeded()
    if kind == "resnet":
        from torchvision.models.resnet import BasicBlock, ResNet

        model: nn.Module = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=4)
        model.fc = nn.Sequential(nn.Dropout(0.2), model.fc)  # ResNet draws nothing itself
        blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
        labels = torch.randint(0, 4, (4,), generator=gen)
        return Built(model, (_images(gen, 4, 32),), blocks, _cross_entropy(labels))
    if kind == "convnext":
        from torchvision.models.convnext import CNBlock as TVCNBlock
        from torchvision.models.convnext import CNBlockConfig, ConvNeXt

        model = ConvNeXt(
            [CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)],
            stochastic_depth_prob=0.3,
            layer_scale=0.5,
            num_classes=4,
        )
        block_type: type[nn.Module] = TVCNBlock
    else:
        from torchvision.models.efficientnet import EfficientNet, MBConv, MBConvConfig

        model = EfficientNet(
            [MBConvConfig(1, 3, 1, 16, 16, 2), MBConvConfig(4, 3, 2, 16, 24, 2)],
            dropout=0.2,
            stochastic_depth_prob=0.3,
            num_classes=4,
            last_channel=64,
        )
        block_type = MBConv
    assert tv.ops.StochasticDepth in {type(m) for m in model.modules()}
    blocks = [m for m in model.modules() if isinstance(m, block_type)]
    labels = torch.randint(0, 4, (4,), generator=gen)
    return Built(model, (_images(gen, 4, 32),), blocks, _cross_entropy(labels))


def torch_transformer_encoder() -> Built:
    gen = _seeded()
    layer = nn.TransformerEncoderLayer(
        d_model=32, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(2, 8, 32, generator=gen)
    return Built(model, (x,), list(model.layers), lambda h: h.square().mean())


FAMILIES: dict[str, Callable[[], Built]] = {
    "hf-bert-eager": partial(hf_bert, "eager"),
    "hf-bert-sdpa": partial(hf_bert, "sdpa"),
    "hf-gpt2-eager": partial(hf_gpt2, "eager"),
    "hf-gpt2-sdpa": partial(hf_gpt2, "sdpa"),
    "hf-vit-eager": partial(hf_vit, "eager"),
    "hf-vit-sdpa": partial(hf_vit, "sdpa"),
    "timm-vit-fused": partial(timm_vit, True),
    "timm-vit-unfused": partial(timm_vit, False),
    "timm-resnet-droppath-dropblock": timm_resnet,
    "timm-efficientnet-bnact": timm_efficientnet,
    "torchvision-replica-convnext": partial(torchvision_replica, "convnext"),
    "torchvision-replica-mbconv": partial(torchvision_replica, "mbconv"),
    "torchvision-resnet": partial(torchvision_model, "resnet"),
    "torchvision-convnext": partial(torchvision_model, "convnext"),
    "torchvision-efficientnet": partial(torchvision_model, "efficientnet"),
    "torch-transformer-encoder": torch_transformer_encoder,
}


def _convert(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        # convert names what it leaves alone (BatchNormAct2d, MultiheadAttention dropout).
        warnings.simplefilter("ignore")
        return scopedckpt.convert(model)
