"""Memory and speed of scopedckpt against torch.utils.checkpoint and no checkpointing.

Run by hand (not part of the test suite)::

    pip install -e ".[bench]" && python benchmarks/run.py [--quick] [--compiled | --selective | --fixed-heap]

``--compiled`` runs only the torch.compile section instead (see compiled.py),
``--selective`` only the selective-saving trade-off (see selective.py),
``--fixed-heap`` only the step-time table with glibc's heap trimming and dynamic
mmap threshold off in the workers (``FIXED_HEAP``).

Configurations, all over the same regions (one per block):
  (a) plain torch layers, no checkpointing
  (b) torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True)
  (c) scopedckpt regions with scoped layers
  (d) scoped layers, no checkpointing
  (e) scopedckpt regions with scoped layers, preserve_rng_state=False (no RNG stash):
      (c)/(e) is what replaying unscoped randomness costs the converted fast path
Prints a table of ratios, writes benchmarks/results/results.json and results.png.
Step times: each configuration of a cell runs in its own worker process
(benchmarks/workers.py), stepped in interleaved rounds (a, b, c, d, e, then b, c, d,
e, a, ...), so that machine noise hits every configuration alike while no
configuration's step meets a heap the others left behind; eight times as many rounds
for the cheap small-op MLP. Peak RSS is measured per configuration in its own
subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tc
from torch import nn

import scopedckpt
from scopedckpt._demo import saved_activation_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import breakdown  # benchmarks/breakdown.py, heap.py and workers.py, next to this file
import heap
import workers

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 2  # torch threads, in this process and in every worker
CONFIGS = ("a", "b", "c", "d", "e")
NAMES = {
    "a": "plain nn",
    "b": "torch.utils.checkpoint",
    "c": "scopedckpt",
    "d": "scoped layers, no ckpt",
    "e": "scopedckpt, no RNG stash",
}


class Blocks(nn.Module):
    """A stem, a stack of blocks (the regions) and a head."""

    def __init__(self, blocks: list[nn.Module], stem: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = stem, nn.ModuleList(blocks), head
        self.mode = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            if self.mode == "b":
                x = tc.checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)
            elif self.mode == "c":
                x = scopedckpt.checkpoint(block, x)
            elif self.mode == "e":
                x = scopedckpt.checkpoint(block, x, preserve_rng_state=False)
            else:
                x = block(x)
        return self.head(x)


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Dropout2d(0.1),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.body(x)).relu()


def mlp(depth: int) -> tuple[Blocks, torch.Tensor]:
    w = 512
    blocks = [
        nn.Sequential(nn.Linear(w, w), nn.BatchNorm1d(w), nn.GELU(), nn.Dropout(0.1))
        for _ in range(depth)
    ]
    return Blocks(blocks, nn.Identity(), nn.Linear(w, 10)), torch.randn(256, w)


def transformer(depth: int) -> tuple[Blocks, torch.Tensor]:
    d = 128
    blocks = []
    for _ in range(depth):
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        layer.self_attn.dropout = 0.0  # functional inside torch: not replayable
        blocks.append(layer)
    return Blocks(blocks, nn.Identity(), nn.Linear(d, 10)), torch.randn(16, 64, d)


def cnn(depth: int) -> tuple[Blocks, torch.Tensor]:
    c = 32
    stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
    return Blocks([ResBlock(c) for _ in range(depth)], stem, head), torch.randn(16, 3, 32, 32)


def small_mlp(depth: int) -> tuple[Blocks, torch.Tensor]:
    """Small ops, where per-region Python shows: Linear(256)-BN-GELU-Dropout-Linear, batch 128."""
    w = 256
    blocks = [
        nn.Sequential(
            nn.Linear(w, w), nn.BatchNorm1d(w), nn.GELU(), nn.Dropout(0.1), nn.Linear(w, w)
        )
        for _ in range(depth)
    ]
    return Blocks(blocks, nn.Identity(), nn.Linear(w, 10)), torch.randn(128, w)


def wide_mlp(depth: int) -> tuple[Blocks, torch.Tensor]:
    """Large matmuls, few ops (selective saving only): Linear(1024, 2048)-GELU-Dropout-
    Linear(2048, 1024), batch 256."""
    w = 1024
    blocks = [
        nn.Sequential(nn.Linear(w, 2 * w), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * w, w))
        for _ in range(depth)
    ]
    return Blocks(blocks, nn.Identity(), nn.Linear(w, 10)), torch.randn(256, w)


MODELS: dict[str, Callable[[int], tuple[Blocks, torch.Tensor]]] = {
    "small_mlp": small_mlp,
    "mlp": mlp,
    "transformer": transformer,
    "cnn": cnn,
}


def build(kind: str, depth: int, config: str) -> tuple[Blocks, torch.Tensor]:
    torch.manual_seed(0)
    model, x = MODELS[kind](depth)
    if config in ("c", "d", "e"):
        model = scopedckpt.convert(model)
    model.mode = config
    return model, x


def step(model: Blocks, x: torch.Tensor) -> None:
    with scopedckpt.checkpointing(enabled=model.mode in ("c", "e")):
        loss = model(x).square().mean()
    loss.backward()
    for p in model.parameters():
        p.grad = None


def saved_bytes(model: Blocks, x: torch.Tensor) -> int:
    def forward() -> torch.Tensor:
        with scopedckpt.checkpointing(enabled=model.mode in ("c", "e")):
            return model(x)

    return saved_activation_bytes(forward, exclude=model.parameters())


# More rounds where steps are cheap and a few percent is the question: the
# small-op MLP's cells moved by up to 0.25 between runs at 15 rounds.
ROUNDS_FACTOR = {"small_mlp": 8}  # 168 rounds
RATIOS = (("c", "b"), ("c", "a"), ("d", "a"), ("c", "e"))


def measure(
    steppers: workers.StepWorkers, kind: str, depth: int, repeats: int
) -> dict[str, object]:
    """Step times of every configuration, each in its own worker process
    (benchmarks/workers.py); ratios are paired (breakdown.paired): the median over
    rounds of the two configurations' times in the same round."""
    times, faults, facts = steppers.rounds(kind, depth, repeats * ROUNDS_FACTOR.get(kind, 1))
    saved = {c: facts[c]["saved_bytes"] for c in CONFIGS}
    row: dict[str, object] = {
        "model": kind,
        "depth": depth,
        "rounds": len(times["a"]),
        "median_s": {c: statistics.median(t) for c, t in times.items()},
        "median_minor_faults": {c: statistics.median(f) for c, f in faults.items()},
        "saved_bytes": saved,
    }
    for numerator, denominator in RATIOS:
        median, low, high = breakdown.paired(times, numerator, denominator)
        row[f"{numerator}/{denominator}"] = median
        row[f"{numerator}/{denominator} 95% interval"] = [low, high]
    row["saved c-b per dropout call"] = (saved["c"] - saved["b"]) / max(1, facts["c"]["dropouts"])
    return row


def dropouts(model: nn.Module) -> int:
    """How many dropout layers (torch's or scoped) the model has."""
    return sum(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def step_peak_mib(kind: str, depth: int, config: str) -> float:
    """Run in a fresh process: peak RSS of one step above the RSS before it (Linux)."""
    model, x = build(kind, depth, config)
    # The first step: later ones reuse heap pages freed by earlier ones, which
    # hides their peak from RSS.
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    before = _status_kib("VmRSS")
    step(model, x)
    return (_status_kib("VmHWM") - before) / 1024


def peak_rss_mib(kind: str, depth: int, config: str) -> float:
    """Peak resident memory a training step adds, each configuration in its own subprocess."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import run; "
        f"print(run.step_peak_mib({kind!r}, {depth}, {config!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def peak_heap_mib(kind: str, depth: int, config: str) -> float:
    """Peak heap bytes in use during a step (after a warm-up step), above those before it."""
    model, x = build(kind, depth, config)
    step(model, x)
    return heap.peak_in_use(lambda: step(model, x)) / 2**20


def measurement_overheads(kind: str, depth: int, repeats: int) -> dict[str, float]:
    """What measuring costs (c): the heap sampler, and scopedckpt.memory_report()."""
    model, x = build(kind, depth, "c")
    step(model, x)

    def reported() -> None:
        with scopedckpt.memory_report():
            step(model, x)

    # A few percent, measured: interleaved rounds on the same model (two models
    # differ by as much here), four times as many as the step-time table's, paired.
    times = breakdown.interleaved_rounds(
        {"plain": lambda: step(model, x), "reported": reported}, calls=1, rounds=4 * repeats
    )
    median, low, high = breakdown.paired(times, "reported", "plain")
    return {
        "heap sampler": heap.sampling_overhead(lambda: step(model, x), repeats),
        "memory_report": median,
        "memory_report 95% interval low": low,
        "memory_report 95% interval high": high,
    }


def dropout_bytes_per_element() -> dict[str, float]:
    """Bytes a lone dropout keeps for backward, per input element."""
    x = torch.randn(1 << 20, requires_grad=True)
    n = x.numel()
    result = {}
    for name, layer in (
        ("nn.Dropout", nn.Dropout(0.1)),
        ("scopedckpt.Dropout(save_mask=True)", scopedckpt.Dropout(0.1)),
        ("scopedckpt.Dropout(save_mask=False)", scopedckpt.Dropout(0.1, save_mask=False)),
    ):
        result[name] = saved_activation_bytes(lambda layer=layer: layer(x)) / n
    return result


def dropout_step_ratio(repeats: int) -> dict[str, dict[str, float]]:
    """Forward+backward time of the two scoped mask options relative to nn.Dropout, by size."""
    result = {}
    for rows, cols in ((64, 64), (256, 256), (1024, 1024)):
        x = torch.randn(rows, cols, requires_grad=True)
        layers = {
            "nn": nn.Dropout(0.1),
            "save": scopedckpt.Dropout(0.1),
            "regen": scopedckpt.Dropout(0.1, save_mask=False),
        }
        calls = max(1, (1 << 16) // (rows * cols)) * 4  # per sample: enough to time
        median = breakdown.interleaved(
            {k: (lambda m=m, x=x: m(x).sum().backward()) for k, m in layers.items()},
            calls=calls,
            rounds=repeats,
        )
        base = median["nn"]
        result[f"{rows}x{cols}"] = {k: seconds / base for k, seconds in median.items()}
    return result


def step_table(depths: tuple[int, ...], repeats: int) -> list[dict[str, object]]:
    """Every model at every depth, in one set of workers (benchmarks/workers.py)."""
    rows = []
    with workers.StepWorkers(CONFIGS, THREADS) as steppers:
        for kind in MODELS:
            for depth in depths:
                rows.append(measure(steppers, kind, depth, repeats))
                print(f"measured {kind} depth {depth}", file=sys.stderr)
    return rows


def print_step_table(rows: list[dict[str, Any]]) -> None:
    """The step-time table: ratios, saved MiB and minor page faults per step."""
    print(
        "\nstep time ratios: paired medians over rounds, (c)/(b) with its 95 % interval;"
        " minor page faults per step, median"
        f"\n{'model':<12}{'depth':>6}{'rounds':>7}{'(c)/(b) time':>14}{'interval':>15}"
        f"{'(c)/(a)':>9}{'(d)/(a)':>9}{'(c)/(e)':>9}"
        f"{'saved MiB a':>13}{'b':>8}{'c':>8}{'d':>8}{'faults a':>10}{'b':>6}{'c':>6}{'d':>6}"
    )
    for r in rows:
        s, f = r["saved_bytes"], r["median_minor_faults"]
        low, high = r["c/b 95% interval"]
        print(
            f"{r['model']:<12}{r['depth']:>6}{r['rounds']:>7}{r['c/b']:>14.3f}"
            f"{f'{low:.3f}-{high:.3f}':>15}"
            f"{r['c/a']:>9.3f}{r['d/a']:>9.3f}{r['c/e']:>9.3f}"
            f"{s['a'] / 2**20:>13.2f}{s['b'] / 2**20:>8.2f}{s['c'] / 2**20:>8.2f}{s['d'] / 2**20:>8.2f}"
            f"{f['a']:>10.0f}{f['b']:>6.0f}{f['c']:>6.0f}{f['d']:>6.0f}"
        )


# glibc tunables, read when a process starts: blocks under 32 MiB (glibc's largest
# allowed threshold on 64-bit) come from the heap, setting it switches the dynamic
# threshold off, and the heap's top is not trimmed under 1 GiB free, so freed pages
# stay mapped and a step's page faults no longer depend on the heap's history.
FIXED_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def run_fixed_heap(depths: tuple[int, ...], repeats: int, quick: bool) -> None:
    """The step-time table with glibc's heap trimming and dynamic mmap threshold off."""
    os.environ.update(FIXED_HEAP)  # inherited by the spawned workers
    rows = step_table(depths, repeats)
    print(f"\nglibc tunables in the workers: {FIXED_HEAP}")
    print_step_table(rows)
    (RESULTS / "fixed_heap.json").write_text(
        json.dumps(
            {"rows": rows, "tunables": FIXED_HEAP, "quick": quick, "torch": torch.__version__},
            indent=2,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sweep without peak RSS, under 2 minutes"
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="only the torch.compile section (benchmarks/compiled.py)",
    )
    parser.add_argument(
        "--selective",
        action="store_true",
        help="only the selective-saving section (benchmarks/selective.py)",
    )
    parser.add_argument(
        "--fixed-heap",
        action="store_true",
        help="only the step-time table, with glibc's heap trimming and dynamic mmap "
        "threshold off in the workers (results/fixed_heap.json)",
    )
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    if args.compiled:
        run_compiled(args.quick)
        return
    if args.selective:
        run_selective(args.quick)
        return
    repeats = 3 if args.quick else 21
    depths = (4, 8) if args.quick else (4, 8, 16, 32)
    RESULTS.mkdir(exist_ok=True)
    if args.fixed_heap:
        run_fixed_heap(depths, repeats, args.quick)
        return
    rows = step_table(depths, repeats)
    rss, heap_peak, overheads = {}, {}, {}
    for kind in MODELS:
        depth = depths[-1]
        if not args.quick:  # a subprocess per configuration: most of --quick's time
            rss[kind] = {c: peak_rss_mib(kind, depth, c) for c in CONFIGS}
        heap_peak[kind] = {c: peak_heap_mib(kind, depth, c) for c in CONFIGS}
        overheads[kind] = measurement_overheads(kind, depth, repeats)
    per_element = dropout_bytes_per_element()
    dropout_ratio = dropout_step_ratio(repeats * 4)
    print("\nwhere the remaining time goes (benchmarks/breakdown.py):")
    remaining = breakdown.main(rounds=5 if args.quick else 21)

    print_step_table(rows)
    print(
        f"\npeak heap in use during a step at depth {depths[-1]} (MiB above the heap before it, "
        "mallinfo2 after every aten op):"
    )
    for kind, values in heap_peak.items():
        print(f"  {kind:<12}" + "  ".join(f"{NAMES[c]}: {v:.2f}" for c, v in values.items()))
    print(
        f"\npeak RSS a step adds at depth {depths[-1]} (MiB above the RSS before it, own "
        "subprocess; glibc's dynamic mmap threshold makes it vary, see docs/benchmarks.md):"
    )
    for kind, values in rss.items():
        print(f"  {kind:<12}" + "  ".join(f"{NAMES[c]}: {v:.0f}" for c, v in values.items()))
    print("\nstep time of (c) with the heap sampler / memory_report() on, over off:")
    for kind, values in overheads.items():
        print(f"  {kind:<12}" + "  ".join(f"{k}: {v:.3f}" for k, v in values.items()))
    print("\ndropout alone, bytes kept for backward per element:")
    for name, value in per_element.items():
        print(f"  {name:<40}{value:.3f}")
    print("dropout alone, forward+backward time relative to nn.Dropout (save: save_mask=True):")
    for size, ratios in dropout_ratio.items():
        print(f"  {size:<12}" + ", ".join(f"{k}: {v:.2f}" for k, v in ratios.items()))
    (RESULTS / "results.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "peak_rss_mib": rss,
                "peak_heap_in_use_mib": heap_peak,
                "measurement_overheads": overheads,
                "dropout_bytes_per_element": per_element,
                "dropout_time_ratio": dropout_ratio,
                "breakdown": remaining,
                "quick": args.quick,
                "torch": torch.__version__,
            },
            indent=2,
        )
    )
    plot(rows)


def run_compiled(quick: bool) -> None:
    import compiled

    depth = 4 if quick else 8
    models = {
        "issue mlp x4": lambda: compiled.issue_mlp(Blocks),
        f"mlp x{depth}": lambda: mlp(depth),
        f"transformer x{depth}": lambda: transformer(depth),
        f"cnn x{depth}": lambda: cnn(depth),
    }
    rows = compiled.run(models, repeats=5 if quick else 21)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compiled.json").write_text(
        json.dumps({"rows": rows, "quick": quick, "torch": torch.__version__}, indent=2)
    )


def run_selective(quick: bool) -> None:
    import selective

    depth = 4 if quick else 8
    models = {
        f"mlp x{depth}": lambda: mlp(depth),
        f"transformer x{depth}": lambda: transformer(depth),
        f"cnn x{depth}": lambda: cnn(depth),
        "wide_mlp x4": lambda: wide_mlp(4),
    }
    rows = selective.run(models, repeats=3 if quick else 11)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "selective.json").write_text(
        json.dumps({"rows": rows, "quick": quick, "torch": torch.__version__}, indent=2)
    )
    selective.plot(rows, RESULTS / "selective.png")


def plot(rows: list[dict[str, object]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(MODELS), figsize=(4 * len(MODELS), 7))
    for col, kind in enumerate(MODELS):
        mine = [r for r in rows if r["model"] == kind]
        depths = [r["depth"] for r in mine]
        for c in CONFIGS:
            axes[0][col].plot(
                depths, [r["saved_bytes"][c] / 2**20 for r in mine], "o-", label=NAMES[c]
            )
            axes[1][col].plot(depths, [r["median_s"][c] * 1e3 for r in mine], "o-", label=NAMES[c])
        axes[0][col].set_title(kind)
        axes[0][col].set_ylabel("saved for backward (MiB)")
        axes[1][col].set_ylabel("step time (ms, median)")
        axes[1][col].set_xlabel("blocks")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "results.png", dpi=100)


if __name__ == "__main__":
    main()
