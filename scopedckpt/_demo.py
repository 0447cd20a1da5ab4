"""``python -m scopedckpt``: show exactness and memory saved on a small MLP."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

from ._checkpoint import checkpoint
from ._convert import convert
from ._scope import checkpointing

__all__ = ["main", "saved_activation_bytes"]


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


def _model(depth: int, width: int) -> nn.Sequential:
    blocks = [
        nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(), nn.Dropout(0.1))
        for _ in range(depth)
    ]
    return nn.Sequential(*blocks)


def main(depth: int = 8, width: int = 256, batch: int = 512) -> None:
    """Train one step four ways and print what each did."""
    torch.manual_seed(0)
    base = _model(depth, width)
    x = torch.randn(batch, width)

    def step(how: str) -> tuple[nn.Sequential, list[Tensor], int]:
        model = copy.deepcopy(base)
        if how.startswith("scoped"):
            convert(model)  # in place: the blocks' layers are swapped
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        out: dict[str, Tensor] = {}

        def forward() -> Tensor:
            h = xi
            for block in model:
                if how.startswith("torch"):
                    h = torch_checkpoint.checkpoint(
                        block, h, use_reentrant=False, preserve_rng_state="no RNG" not in how
                    )
                else:
                    h = checkpoint(block, h)  # a plain call outside an enabled scope
            out["loss"] = h.square().mean()
            return out["loss"]

        with checkpointing(enabled=how.endswith("scopedckpt")):
            saved = saved_activation_bytes(forward, exclude=model.parameters())
        out["loss"].backward()
        grads = [g for g in (xi.grad, *(p.grad for p in model.parameters())) if g is not None]
        return model, grads, saved

    # Each checkpointed run is compared with the same layers run without it.
    plain = step("plain nn, no checkpointing")
    scoped = step("scoped layers, no checkpointing")
    runs = [
        ("plain nn, no checkpointing", plain, plain),
        ("torch.utils.checkpoint, RNG stash", step("torch, RNG stash"), plain),
        ("torch.utils.checkpoint, no RNG stash", step("torch, no RNG stash"), plain),
        ("plain nn in scopedckpt (not converted)", step("plain nn in scopedckpt"), plain),
        ("scoped layers, no checkpointing", scoped, scoped),
        ("scopedckpt", step("scopedckpt"), scoped),
    ]

    def equal(a: Iterable[Tensor], b: Iterable[Tensor]) -> str:
        return "bitwise" if all(torch.equal(p, q) for p, q in zip(a, b)) else "DIFFERENT"

    header = (
        f"{'one step, ' + str(depth) + ' blocks of Linear-BN-GELU-Dropout':<44}"
        f"{'grads':>11}{'BN buffers':>12}{'BN updates':>12}{'saved MiB':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, (model, grads, saved), (ref_model, ref_grads, _) in runs:
        grads_equal = equal(grads, ref_grads)
        buffers = equal(model.buffers(), ref_model.buffers())
        first_norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
        updates = int(first_norm.num_batches_tracked or 0)
        print(f"{name:<44}{grads_equal:>11}{buffers:>12}{updates:>12}{saved / 2**20:>11.2f}")
    print(
        "\ngrads and BN buffers: compared with the same layers run without checkpointing.\n"
        f"scopedckpt keeps {runs[-1][1][2] / scoped[2]:.0%} of the activation memory and matches "
        "bit for bit, converted or not; torch.utils.checkpoint updates batch norm twice and, "
        "without its RNG stash, replays dropout with new masks."
    )
