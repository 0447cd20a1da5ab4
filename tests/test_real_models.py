"""Third-party models: checkpointed training must equal plain training bit for bit.

Tiny, randomly initialised models built from configs (nothing is downloaded) from
Hugging Face transformers (BERT, GPT-2, ViT; eager and SDPA attention), timm (ViT with
fused and unfused attention, ResNet with DropPath and DropBlock, an EfficientNet with
``BatchNormAct2d``), torchvision's ``StochasticDepth`` (a replica, and the real models
when torchvision imports) and ``nn.TransformerEncoder``. Every model trains with
dropout, attention dropout and stochastic depth switched on, so the randomness that
checkpoint recomputes must replay is really drawn.

Each family is checked three ways:

- ``test_checkpointed_training_is_exact``: ``assert_checkpoint_equivalent`` over the
  per-layer blocks, as shipped and after ``scopedckpt.convert``;
- ``test_plain_training_is_sane``: the model trains (finite loss and gradients, every
  target block on the gradient path), its randomness is live (two seeds give two
  outputs) and it is deterministic from one seed;
- ``test_eval_mode_is_exact``: in eval mode (no randomness, no buffer updates) the
  comparison passes, so a failure of the first test is the model's randomness or
  buffers, never the wrapper, the inputs or the targets.

Families skip when their package is missing (``pip install -e '.[real]'``). timm
imports torchvision at import time (``timm/layers/create_norm.py``,
``timm/layers/norm_act.py``, ``timm/data/transforms.py``) although none of the models
here use it; where torchvision cannot be imported (not installed, or a CUDA build next
to a CPU torch) ``_timm`` imports timm with a stand-in torchvision that exists only
during that import. See :func:`_import_timm_without_torchvision`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import scopedckpt
from scopedckpt.testing import assert_checkpoint_equivalent

# Models come from configs only; never reach the Hugging Face Hub. Set before
# transformers or huggingface_hub is imported: both read it at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.slow

STEPS = 3
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
    if kind == "convnext":
        from torchvision.models.convnext import CNBlock as TVCNBlock
        from torchvision.models.convnext import CNBlockConfig, ConvNeXt

        model: nn.Module = ConvNeXt(
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
    "torchvision-convnext": partial(torchvision_model, "convnext"),
    "torchvision-efficientnet": partial(torchvision_model, "efficientnet"),
    "torch-transformer-encoder": torch_transformer_encoder,
}


def _convert(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        # convert names what it leaves alone (BatchNormAct2d, MultiheadAttention dropout).
        warnings.simplefilter("ignore")
        return scopedckpt.convert(model)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("converted", [False, True], ids=["as-shipped", "converted"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpointed_training_is_exact(family: str, converted: bool) -> None:
    built = FAMILIES[family]()
    model = _convert(built.model) if converted else built.model
    model.train()
    assert_checkpoint_equivalent(
        model, *built.inputs, targets=built.targets, steps=STEPS, loss_fn=built.loss_fn
    )


def _train(built: Built, seed: int, steps: int = STEPS) -> tuple[list[Tensor], list[Tensor]]:
    """Plain SGD steps from ``seed``; the outputs and the losses."""
    model, params = built.model, [p for p in built.model.parameters() if p.requires_grad]
    outputs, losses = [], []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            for p in params:
                p.grad = None
            output = model(*built.inputs)
            loss = built.loss_fn(output)
            loss.backward()
            outputs.append(output.detach().clone())
            losses.append(loss.detach().clone())
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.sub_(p.grad, alpha=0.01)
    return outputs, losses


def _equal(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plain_training_is_sane(family: str) -> None:
    built = FAMILIES[family]()
    names = {id(m): n for n, m in built.model.named_modules()}
    assert built.targets and all(id(t) in names for t in built.targets)
    built.model.train()
    state = {k: v.clone() for k, v in built.model.state_dict().items()}

    outputs, losses = _train(built, seed=0)
    assert all(math.isfinite(float(loss)) for loss in losses), losses
    for target in built.targets:  # every target is on the gradient path
        grads = [p.grad for p in target.parameters() if p.grad is not None]
        assert grads, f"{names[id(target)]} got no gradient"
        assert all(bool(torch.isfinite(g).all()) for g in grads)
        assert any(bool(g.ne(0).any()) for g in grads), f"{names[id(target)]}: zero grads"

    built.model.load_state_dict(state)
    again, _ = _train(built, seed=0)
    assert _equal(outputs, again), "plain training is not deterministic from one seed"
    built.model.load_state_dict(state)
    other, _ = _train(built, seed=1, steps=1)
    assert not torch.equal(outputs[0], other[0]), "no randomness: dropout/drop-path inactive?"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eval_mode_is_exact(family: str) -> None:
    """The control: with no randomness and no buffer updates, nothing may differ."""
    built = FAMILIES[family]()
    built.model.eval()
    assert_checkpoint_equivalent(
        built.model, *built.inputs, targets=built.targets, steps=STEPS, loss_fn=built.loss_fn
    )


def _train_step_in_scope(built: Built) -> None:
    output: Any = None
    try:
        with scopedckpt.checkpointing(*built.targets):
            output = built.model(*built.inputs)
        built.loss_fn(output).backward()
    finally:
        output = None  # the graph holds regions: let the traceback not keep them alive


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_use_cache_in_a_region_is_refused(attn: str) -> None:
    """GPT-2 builds a DynamicCache when use_cache=True, even in training, and each block
    appends its keys and values to it: a recompute would append them a second time."""
    built = hf_gpt2(attn, use_cache=True)
    built.model.train()
    _train(built, seed=0, steps=1)  # fine without checkpointing
    with pytest.raises(scopedckpt.ScopedCkptError, match="use_cache"):
        _train_step_in_scope(built)


def _hf_family(name: str) -> Built:
    """A family by name, or GPT-2 with the config default use_cache=True."""
    if name == "gpt2-use-cache":  # the config default: Hugging Face turns it off itself
        return hf_gpt2("sdpa", use_cache=True)
    return FAMILIES[name]()


@pytest.mark.parametrize(
    "name", ["hf-bert-eager", "hf-gpt2-eager", "gpt2-use-cache", "hf-vit-sdpa"]
)
def test_huggingface_gradient_checkpointing_through_scopedckpt_is_exact(name: str) -> None:
    """One line routes Hugging Face's own checkpointing through scopedckpt regions."""
    from scopedckpt._engine import COUNTERS
    from scopedckpt.integrations import huggingface

    plain, checkpointed = _hf_family(name), _hf_family(name)
    hf_model = checkpointed.model.model
    assert huggingface.gradient_checkpointing_enable(hf_model) is hf_model
    for built in (plain, checkpointed):
        built.model.train()
    rng = torch.get_rng_state()
    before = COUNTERS.regions
    with torch.random.fork_rng(devices=[]):
        expected = _train(plain, seed=3)
        expected_rng = torch.get_rng_state()
    with torch.random.fork_rng(devices=[]):
        got = _train(checkpointed, seed=3)
        got_rng = torch.get_rng_state()
    assert COUNTERS.regions - before == STEPS * len(checkpointed.targets)
    assert _equal(got[0] + got[1], expected[0] + expected[1])
    assert torch.equal(got_rng, expected_rng)
    for (key, a), b in zip(
        checkpointed.model.state_dict().items(), plain.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), key
    assert torch.equal(torch.get_rng_state(), rng)


def test_huggingface_integration_refuses_models_without_checkpointing() -> None:
    from scopedckpt.integrations import huggingface

    with pytest.raises(TypeError, match="expected a Hugging Face PreTrainedModel"):
        huggingface.gradient_checkpointing_enable(nn.Linear(2, 2))


def _enable_library_checkpointing(model: nn.Module) -> None:
    """The library's own switch: Hugging Face's or timm's, calling torch's checkpoint."""
    inner = getattr(model, "model", model)
    if hasattr(inner, "activation_checkpointing_enable"):
        inner.activation_checkpointing_enable()
    else:
        inner.set_grad_checkpointing()


@pytest.mark.parametrize(
    "name",
    [
        "hf-bert-eager",
        "hf-gpt2-sdpa",
        "gpt2-use-cache",
        "hf-vit-eager",
        "timm-vit-unfused",
        "timm-resnet-droppath-dropblock",
        "timm-efficientnet-bnact",
    ],
)
def test_library_checkpointing_under_patch_torch_checkpoint_is_exact(name: str) -> None:
    """timm's set_grad_checkpointing and Hugging Face's own switch, unchanged, made exact."""
    from scopedckpt._engine import COUNTERS
    from scopedckpt.integrations import patch_torch_checkpoint

    plain, checkpointed = _hf_family(name), _hf_family(name)
    _enable_library_checkpointing(checkpointed.model)
    for built in (plain, checkpointed):
        built.model.train()
    with torch.random.fork_rng(devices=[]):
        expected = _train(plain, seed=3)
        expected_rng = torch.get_rng_state()
    before = COUNTERS.regions
    with torch.random.fork_rng(devices=[]), patch_torch_checkpoint():
        got = _train(checkpointed, seed=3)
        got_rng = torch.get_rng_state()
    assert COUNTERS.regions > before
    assert _equal(got[0] + got[1], expected[0] + expected[1])
    assert torch.equal(got_rng, expected_rng)
    for (key, a), b in zip(
        checkpointed.model.state_dict().items(), plain.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), key
