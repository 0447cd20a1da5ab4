"""``python -m scopedckpt``: exactness and memory kept for backward, on a small MLP."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

from .core._checkpoint import checkpoint
from .core._scope import checkpointing
from .layers._convert import convert

__all__ = ["main", "saved_activation_bytes", "table"]


def saved_activation_bytes(run: Callable[[], object], exclude: Iterable[Tensor] = ()) -> int:
    """Bytes autograd keeps for backward while ``run()`` builds its graph.

    Counts each storage once (unique data pointers) and skips the storages of
    ``exclude`` (pass the parameters: they exist with or without a graph).
    Checkpoint regions keep only their inputs, which this sees, since torch
    saves them through the same hooks.

    Example
    -------
    >>> import torch
    >>> w = torch.ones(4, 4, requires_grad=True)
    >>> saved_activation_bytes(lambda: torch.ones(2, 4) @ w, exclude=[w])
    32
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        keep = run()
    del keep
    return sum(storages.values())


class _Run(NamedTuple):
    model: nn.Sequential
    grads: list[Tensor]
    kept: int  # bytes kept for backward


def table(depth: int = 8, width: int = 256, batch: int = 512) -> str:
    """Train one step six ways; the demo's output: the table and the lines under it.

    Deterministic on a given torch: the README shows it verbatim (tests/test_docs.py).
    """
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(), nn.Dropout(0.1))
        for _ in range(depth)
    ]
    base = nn.Sequential(*blocks)
    x = torch.randn(batch, width)

    def step(*, scoped: bool = False, region: str = "none", rng_stash: bool = True) -> _Run:
        """``region``: "none", "torch" (torch.utils.checkpoint) or "scopedckpt"."""
        model = copy.deepcopy(base)
        if scoped:
            convert(model)  # in place: the blocks' layers are swapped
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        out: dict[str, Tensor] = {}

        def forward() -> Tensor:
            h = xi
            for block in model:
                if region == "torch":
                    h = torch_checkpoint.checkpoint(
                        block, h, use_reentrant=False, preserve_rng_state=rng_stash
                    )
                else:
                    h = checkpoint(block, h)  # a plain call outside an enabled scope
            out["loss"] = h.square().mean()
            return out["loss"]

        with checkpointing(enabled=region == "scopedckpt"):
            kept = saved_activation_bytes(forward, exclude=model.parameters())
        out["loss"].backward()
        grads = [g for g in (xi.grad, *(p.grad for p in model.parameters())) if g is not None]
        return _Run(model, grads, kept)

    # Each checkpointed run is compared with the same layers run without checkpointing:
    # converting changes the random stream (scoped dropout draws its masks its own way).
    plain = step()
    scoped = step(scoped=True)
    converted = step(scoped=True, region="scopedckpt")
    runs = [
        ("plain nn, no checkpointing", plain, plain),
        ("torch.utils.checkpoint, RNG stash", step(region="torch"), plain),
        ("torch.utils.checkpoint, no RNG stash", step(region="torch", rng_stash=False), plain),
        ("scopedckpt, nn layers as they are", step(region="scopedckpt"), plain),
        ("scoped layers, no checkpointing", scoped, scoped),
        ("scopedckpt, converted layers", converted, scoped),
    ]

    def equal(a: Iterable[Tensor], b: Iterable[Tensor]) -> str:
        return "bitwise" if all(torch.equal(p, q) for p, q in zip(a, b)) else "DIFFERENT"

    header = (
        f"{'run':<38}{'grads':>11}{'BN buffers':>12}{'BN updates':>12}{'kept for backward':>20}"
    )
    lines = [
        f"One training step: {depth} blocks of Linear-BatchNorm1d-GELU-Dropout, "
        f"batch {batch} x {width}.",
        "",
        header,
        "-" * len(header),
    ]
    for name, run, ref in runs:
        grads = equal(run.grads, ref.grads)
        buffers = equal(run.model.buffers(), ref.model.buffers())
        first_norm = next(m for m in run.model.modules() if isinstance(m, nn.BatchNorm1d))
        updates = int(first_norm.num_batches_tracked or 0)
        kept = f"{run.kept / 2**20:.2f} MiB"
        lines.append(f"{name:<38}{grads:>11}{buffers:>12}{updates:>12}{kept:>20}")
    lines += [
        "",
        "grads, BN buffers: bit for bit against the same layers without checkpointing",
        "  (converted layers against 'scoped layers': scopedckpt.convert(model), no regions).",
        "BN updates: times the first BatchNorm counted the step (num_batches_tracked).",
        "kept for backward: bytes of the tensors autograd keeps from forward for backward.",
        "RNG stash: preserve_rng_state=True, torch's default.",
        "",
        f"scopedckpt keeps {converted.kept / plain.kept:.0%} of what plain nn without checkpointing "
        f"keeps ({converted.kept / 2**20:.2f} of {plain.kept / 2**20:.2f} MiB),",
        "as much as torch.utils.checkpoint, and trains bit for bit the same, converted or not.",
    ]
    return "\n".join(lines)


def main(depth: int = 8, width: int = 256, batch: int = 512) -> None:
    """Print the demo's table (``python -m scopedckpt``)."""
    print(table(depth, width, batch))
