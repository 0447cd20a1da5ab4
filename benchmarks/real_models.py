"""Real models: is checkpointed training bit-for-bit plain training?

Run by hand (not part of the test suite)::

    pip install -e ".[real]" && pip install --no-deps timm==1.0.31
    python benchmarks/real_models.py

Tiny, randomly initialised models from configs (nothing is downloaded) with dropout,
attention dropout and stochastic depth on, the families of tests/test_real_models.py
(kept separate: neither imports the other). Each trains 3 SGD steps from the same seed,
four ways:

  (a) no checkpointing: the reference;
  (b) torch.utils.checkpoint(use_reentrant=False), default preserve_rng_state=True, one
      region per block, through the library's own switch where it has one:
      Hugging Face ``activation_checkpointing_enable({"use_reentrant": False})``
      (``gradient_checkpointing_enable`` before transformers 5.x), timm
      ``set_grad_checkpointing()`` (``checkpoint_seq``, use_reentrant=False by default);
      elsewhere each block's forward is replaced by one that calls ``checkpoint``;
  (c) ``scopedckpt.checkpointing(*blocks)`` on the model as shipped;
  (d) the same after ``scopedckpt.convert(model)``.

(b) and (c) are compared with (a), and (d) with (a'), the converted model trained
without checkpointing (scoped dropout draws its masks its own way, so a converted
model is a different, equally valid, random stream from the model as shipped; the last
column compares (a') with (a)). Compared after every step, with ``torch.equal``:
outputs, loss, every gradient, every buffer, torch's global RNG state and the updated
parameters. A cell says ``bitwise``, the first tensor that differs, or the error.
Imports only torch, scopedckpt, transformers and timm; a family whose package is
missing is skipped with a note.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

import scopedckpt

STEPS = 3
LR = 0.01


# ------------------------------------------------------------------------- packages


class _Placeholder:
    """Any torchvision attribute timm touches while importing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)


class _StandInTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """torchvision for the length of ``import timm`` where the real one cannot import.

    timm 1.0.31 imports torchvision (FrozenBatchNorm2d, transforms) at import time;
    the models here never call into it.
    """

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        class StandIn(types.ModuleType):
            def __getattr__(self, name: str) -> Any:
                if name.startswith("__"):
                    raise AttributeError(name)
                value: Any = (
                    type(name, (nn.Module,), {}) if name == "FrozenBatchNorm2d" else _Placeholder()
                )
                setattr(self, name, value)
                return value

        return StandIn(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def _forget(package: str) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == package]:
        del sys.modules[name]


def import_timm() -> Any:
    try:
        import torchvision  # noqa: F401
    except Exception:
        _forget("torchvision")
        finder = _StandInTorchvision()
        sys.meta_path.insert(0, finder)
        try:
            import timm
        finally:
            sys.meta_path.remove(finder)
            _forget("torchvision")
        return timm
    import timm

    return timm


# ------------------------------------------------------------------------- families


@dataclass
class Built:
    model: nn.Module
    inputs: tuple[Tensor, ...]
    targets: list[nn.Module]
    loss_fn: Callable[[Any], Tensor]
    native: nn.Module | None = None  # the HF or timm model, for its own checkpointing switch


def _gen() -> torch.Generator:
    torch.manual_seed(0)
    return torch.Generator().manual_seed(1)


def _ce(labels: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda logits: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class Call(nn.Module):
    """Calls a keyword-argument model with positional tensors and picks one output."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...], pick: str, **fixed: Any) -> None:
        super().__init__()
        self.model, self.keys, self.pick, self.fixed = model, keys, pick, fixed

    def forward(self, *tensors: Tensor) -> Tensor:
        out = self.model(**dict(zip(self.keys, tensors)), **self.fixed)
        return getattr(out, self.pick)


def hf_bert(attn: str) -> Built:
    import transformers as T

    gen = _gen()
    bert = T.BertModel(
        T.BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
            attn_implementation=attn,
        ),
        add_pooling_layer=False,
    )
    ids, mask = torch.randint(1, 64, (2, 8), generator=gen), torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    model = Call(bert, ("input_ids", "attention_mask"), "last_hidden_state")
    return Built(model, (ids, mask), list(bert.encoder.layer), lambda h: h.square().mean(), bert)


def hf_gpt2(attn: str, use_cache: bool = False) -> Built:
    import transformers as T

    gen = _gen()
    lm = T.GPT2LMHeadModel(
        T.GPT2Config(
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
    )
    ids = torch.randint(0, 64, (2, 8), generator=gen)
    model = Call(lm, ("input_ids",), "logits", use_cache=use_cache)
    loss = lambda logits: F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))  # noqa: E731
    return Built(model, (ids,), list(lm.transformer.h), loss, lm)


def hf_vit(attn: str) -> Built:
    import transformers as T

    gen = _gen()
    vit = T.ViTForImageClassification(
        T.ViTConfig(
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
    )
    x, labels = torch.randn(2, 3, 16, 16, generator=gen), torch.randint(0, 4, (2,), generator=gen)
    model = Call(vit, ("pixel_values",), "logits")
    return Built(model, (x,), list(vit.vit.layers), _ce(labels), vit)


def timm_vit(fused: bool) -> Built:
    timm = import_timm()
    gen = _gen()
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
        block.attn.fused_attn = fused
    x, labels = torch.randn(2, 3, 16, 16, generator=gen), torch.randint(0, 4, (2,), generator=gen)
    return Built(model, (x,), list(model.blocks), _ce(labels), model)


def timm_cnn(name: str, **kwargs: float) -> Built:
    timm = import_timm()
    gen = _gen()
    model = timm.create_model(name, pretrained=False, num_classes=4, drop_rate=0.1, **kwargs)
    stages = (
        [model.layer1, model.layer2, model.layer3, model.layer4]
        if hasattr(model, "layer1")
        else list(model.blocks)
    )
    x, labels = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 4, (4,), generator=gen)
    return Built(model, (x,), [b for s in stages for b in s], _ce(labels), model)


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth(p, "row") (torchvision/ops/stochastic_depth.py)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
        return x * noise.bernoulli_(1.0 - self.p).div_(1.0 - self.p)


class Residual(nn.Module):
    """x + StochasticDepth(body(x)): ConvNeXt's CNBlock and EfficientNet's MBConv."""

    def __init__(self, body: nn.Module, p: float) -> None:
        super().__init__()
        self.body, self.stochastic_depth = body, StochasticDepth(p)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.stochastic_depth(self.body(x))


class Permute(nn.Module):
    def __init__(self, *dims: int) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: Tensor) -> Tensor:
        return x.permute(*self.dims)


def torchvision_replica(kind: str) -> Built:
    gen = _gen()
    d = 16

    def body() -> nn.Module:
        if kind == "convnext":
            return nn.Sequential(
                nn.Conv2d(d, d, 7, padding=3, groups=d),
                Permute(0, 2, 3, 1),
                nn.LayerNorm(d),
                nn.Linear(d, 4 * d),
                nn.GELU(),
                nn.Linear(4 * d, d),
                Permute(0, 3, 1, 2),
            )
        return nn.Sequential(
            nn.Conv2d(d, 2 * d, 1, bias=False),
            nn.BatchNorm2d(2 * d),
            nn.SiLU(),
            nn.Conv2d(2 * d, 2 * d, 3, padding=1, groups=2 * d, bias=False),
            nn.BatchNorm2d(2 * d),
            nn.SiLU(),
            nn.Conv2d(2 * d, d, 1, bias=False),
            nn.BatchNorm2d(d),
        )

    blocks = [Residual(body(), 0.3) for _ in range(2)]
    model = nn.Sequential(
        nn.Conv2d(3, d, 3, padding=1),
        *blocks,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(d, 4),
    )
    x, labels = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)
    return Built(model, (x,), blocks, _ce(labels))


def torch_transformer_encoder() -> Built:
    gen = _gen()
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(2, 8, 32, generator=gen)
    return Built(model, (x,), list(model.layers), lambda h: h.square().mean())


FAMILIES: dict[str, tuple[str | None, Callable[[], Built]]] = {
    "HF BERT, eager": ("transformers", partial(hf_bert, "eager")),
    "HF BERT, sdpa": ("transformers", partial(hf_bert, "sdpa")),
    "HF GPT-2, eager": ("transformers", partial(hf_gpt2, "eager")),
    "HF GPT-2, sdpa": ("transformers", partial(hf_gpt2, "sdpa")),
    "HF GPT-2, sdpa, use_cache=True": ("transformers", partial(hf_gpt2, "sdpa", True)),
    "HF ViT, eager": ("transformers", partial(hf_vit, "eager")),
    "HF ViT, sdpa": ("transformers", partial(hf_vit, "sdpa")),
    "timm ViT, fused_attn": ("timm", partial(timm_vit, True)),
    "timm ViT, unfused": ("timm", partial(timm_vit, False)),
    "timm ResNet, DropPath + DropBlock": (
        "timm",
        partial(timm_cnn, "test_resnet", drop_path_rate=0.3, drop_block_rate=0.3),
    ),
    "timm EfficientNet, BatchNormAct2d": (
        "timm",
        partial(timm_cnn, "test_efficientnet", drop_path_rate=0.3),
    ),
    "torchvision StochasticDepth, ConvNeXt-like": (None, partial(torchvision_replica, "convnext")),
    "torchvision StochasticDepth, MBConv + BN": (None, partial(torchvision_replica, "mbconv")),
    "nn.TransformerEncoder, dropout=0.1": (None, torch_transformer_encoder),
}


# -------------------------------------------------------------------------- methods


def torch_switch(built: Built) -> str:
    """How (b) checkpoints this model."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        if hasattr(built.native, name):
            return f"HF {name}"  # the deprecated alias only where the new name is missing
    if hasattr(built.native, "set_grad_checkpointing"):
        return "timm set_grad_checkpointing"
    return "each block's forward patched"


def enable_torch_checkpoint(built: Built) -> None:
    """(b): the library's own checkpointing switch, or each block's forward patched."""
    switch, native = torch_switch(built), built.native
    if switch == "HF activation_checkpointing_enable":
        native.activation_checkpointing_enable({"use_reentrant": False})  # type: ignore[union-attr]
    elif switch == "HF gradient_checkpointing_enable":
        native.gradient_checkpointing_enable(  # type: ignore[union-attr]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    elif switch == "timm set_grad_checkpointing":
        native.set_grad_checkpointing(True)  # type: ignore[union-attr]
    else:
        for block in built.targets:
            block.forward = partial(torch_checkpoint.checkpoint, block.forward, use_reentrant=False)


def train(built: Built, method: str) -> list[tuple[str, Tensor]]:
    """STEPS SGD steps from seed 0; every tensor worth comparing, in order."""
    model, record = built.model, []
    if method in ("convert", "convert-plain"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scopedckpt.convert(model)
    elif method == "torch":
        enable_torch_checkpoint(built)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def add(name: str, t: Tensor | None) -> None:
        if t is not None:
            record.append((name, t.detach().clone()))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step in range(STEPS):
            tag = f"step {step}:"
            for _, p in params:
                p.grad = None
            if method in ("scoped", "convert"):  # "convert-plain": converted, no checkpointing
                with scopedckpt.checkpointing(*built.targets):
                    output = model(*built.inputs)
            else:
                output = model(*built.inputs)
            loss = built.loss_fn(output)
            add(f"{tag} output", output)
            add(f"{tag} loss", loss)
            loss.backward()
            for name, p in params:
                add(f"{tag} grad {name}", p.grad)
            for name, b in model.named_buffers():
                add(f"{tag} buffer {name}", b)
            add(f"{tag} global RNG state", torch.get_rng_state())
            with torch.no_grad():
                for _, p in params:
                    if p.grad is not None:
                        p.sub_(p.grad, alpha=LR)
            for name, p in params:
                add(f"{tag} param {name}", p)
            del output, loss
    return record


def verdict(reference: list[tuple[str, Tensor]], other: list[tuple[str, Tensor]]) -> str:
    if [n for n, _ in reference] != [n for n, _ in other]:
        return "DIFFERENT: tensor lists"
    for (name, a), (_, b) in zip(reference, other):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            return f"DIFFERENT: {name}"
    return "bitwise"


def main() -> None:
    torch.set_num_threads(1)
    rows, notes, how = [], [], {}
    start = time.perf_counter()
    for label, (package, build) in FAMILIES.items():
        if package is not None and importlib.util.find_spec(package) is None:
            notes.append(f"skipped {label}: {package} is not installed")
            continue
        plain = train(build(), "plain")
        converted = train(build(), "convert-plain")
        cells = []
        for method, reference in (("torch", plain), ("scoped", plain), ("convert", converted)):
            built = build()
            if method == "torch":
                how.setdefault(torch_switch(built), []).append(label)
            try:
                cells.append(verdict(reference, train(built, method)))
            except Exception as error:
                first = str(error).splitlines()[0] if str(error) else ""
                cells.append(f"ERROR: {type(error).__name__}: {first[:100]}")
        cells.append(verdict(plain, converted))
        rows.append((label, *cells))
    print(
        "| model | torch.utils.checkpoint | scopedckpt | scopedckpt + convert "
        "| convert alone, no checkpointing |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    for switch, labels in how.items():
        print(f"torch.utils.checkpoint via {switch}: {'; '.join(labels)}")
    for note in notes:
        print(note)
    print(
        f"{STEPS} SGD steps each; torch {torch.__version__}, "
        f"{time.perf_counter() - start:.1f} s in all."
    )


if __name__ == "__main__":
    main()
