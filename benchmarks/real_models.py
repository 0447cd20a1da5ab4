"""Real models: is checkpointed training bit-for-bit plain training?

Run by hand from the repository root (not part of the test suite)::

    pip install -e ".[real]" && pip install --no-deps timm==1.0.31
    python -m benchmarks.real_models

Tiny, randomly initialised models from configs (nothing is downloaded) with dropout,
attention dropout and stochastic depth on: the families tests/test_real_models.py
trains. Each trains 3 SGD steps from the same seed, four ways:

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
The models are the builders of :mod:`benchmarks.real_families`, which
tests/test_real_models.py trains too, so the table and the tests cover the same
families; a family whose package is missing is listed as skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

import scopedckpt

from .real_families import FAMILIES as BUILDERS
from .real_families import Built, convert_quietly, hf_gpt2
from .real_imports import UnavailableError

STEPS = 3
LR = 0.01


# ------------------------------------------------------------------------- families
# The table's rows: every family of the tests, and GPT-2 with its cache on.
FAMILIES: dict[str, Callable[[], Built]] = {
    "HF BERT, eager": BUILDERS["hf-bert-eager"],
    "HF BERT, sdpa": BUILDERS["hf-bert-sdpa"],
    "HF GPT-2, eager": BUILDERS["hf-gpt2-eager"],
    "HF GPT-2, sdpa": BUILDERS["hf-gpt2-sdpa"],
    "HF GPT-2, sdpa, use_cache=True": partial(hf_gpt2, "sdpa", True),
    "HF ViT, eager": BUILDERS["hf-vit-eager"],
    "HF ViT, sdpa": BUILDERS["hf-vit-sdpa"],
    "timm ViT, fused_attn": BUILDERS["timm-vit-fused"],
    "timm ViT, unfused": BUILDERS["timm-vit-unfused"],
    "timm ResNet, DropPath + DropBlock": BUILDERS["timm-resnet-droppath-dropblock"],
    "timm EfficientNet, BatchNormAct2d": BUILDERS["timm-efficientnet-bnact"],
    "torchvision StochasticDepth, ConvNeXt-like": BUILDERS["torchvision-replica-convnext"],
    "torchvision StochasticDepth, MBConv + BN": BUILDERS["torchvision-replica-mbconv"],
    "torchvision ResNet (BasicBlock)": BUILDERS["torchvision-resnet"],
    "torchvision ConvNeXt": BUILDERS["torchvision-convnext"],
    "torchvision EfficientNet": BUILDERS["torchvision-efficientnet"],
    "nn.TransformerEncoder, dropout=0.1": BUILDERS["torch-transformer-encoder"],
}


def native(built: Built) -> nn.Module:
    """The Hugging Face or timm model inside the test wrapper, for its own switch."""
    return getattr(built.model, "model", built.model)


# -------------------------------------------------------------------------- methods


def torch_switch(built: Built) -> str:
    """How (b) checkpoints this model."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        if hasattr(native(built), name):
            return f"HF {name}"  # the deprecated alias only where the new name is missing
    if hasattr(native(built), "set_grad_checkpointing"):
        return "timm set_grad_checkpointing"
    return "each block's forward patched"


def enable_torch_checkpoint(built: Built) -> None:
    """(b): the library's own checkpointing switch, or each block's forward patched."""
    switch, model = torch_switch(built), native(built)
    if switch == "HF activation_checkpointing_enable":
        model.activation_checkpointing_enable({"use_reentrant": False})  # type: ignore[union-attr]
    elif switch == "HF gradient_checkpointing_enable":
        model.gradient_checkpointing_enable(  # type: ignore[union-attr]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    elif switch == "timm set_grad_checkpointing":
        model.set_grad_checkpointing(True)  # type: ignore[union-attr]
    else:
        for block in built.targets:
            block.forward = partial(torch_checkpoint.checkpoint, block.forward, use_reentrant=False)


def train(built: Built, method: str) -> list[tuple[str, Tensor]]:
    """STEPS SGD steps from seed 0; every tensor worth comparing, in order."""
    model, record = built.model, []
    if method in ("convert", "convert-plain"):
        convert_quietly(model)
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
    for label, build in FAMILIES.items():
        try:
            plain = train(build(), "plain")
        except UnavailableError as missing:
            notes.append(f"skipped {label}: {missing}")
            continue
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
