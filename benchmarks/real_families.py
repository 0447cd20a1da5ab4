"""The real-model families: tiny third-party models built from configs, with regions and a loss.

Shared by ``python -m benchmarks.real_models`` and tests/test_real_models.py (through
tests/real_models.py), so the table and the tests cover the same models. Each builder
returns a :class:`Built` from seed 0, with dropout, attention dropout and stochastic
depth on, and raises :class:`benchmarks.real_imports.UnavailableError` when its package
is missing. Nothing is downloaded.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import scopedckpt

from .real_imports import import_timm, import_torchvision, import_transformers
from .torchvision_replicas import CNBlock, MBConv


@dataclass
class Built:
    """A model, its inputs, the per-layer blocks to make regions of, and its loss."""

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
    transformers = import_transformers()
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
    transformers = import_transformers()
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
    transformers = import_transformers()
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
    timm = import_timm()
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
    timm = import_timm()
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
    timm = import_timm()
    gen = _seeded()
    # Every norm is timm.layers.BatchNormAct2d (a BatchNorm2d subclass with its own forward).
    model = timm.create_model(
        "test_efficientnet", pretrained=False, num_classes=4, drop_rate=0.1, drop_path_rate=0.3
    )
    assert any(type(m).__name__ == "BatchNormAct2d" for m in model.modules())
    blocks = [b for stage in model.blocks for b in stage]
    labels = torch.randint(0, 4, (4,), generator=gen)
    return Built(model, (_images(gen, 4, 32),), blocks, _cross_entropy(labels))


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
    tv = import_torchvision()
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


def convert_quietly(model: nn.Module) -> nn.Module:
    """``scopedckpt.convert(model)`` without its warnings about what it leaves alone."""
    with warnings.catch_warnings():
        # convert names what it leaves alone (BatchNormAct2d, MultiheadAttention dropout).
        warnings.simplefilter("ignore")
        return scopedckpt.convert(model)
