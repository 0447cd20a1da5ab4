"""The example and the cost of ``scopedckpt.peak_report()`` in docs/memory.md ("Where did my
memory go").

Run as ``python -m benchmarks.peak [--rounds N] [--html PATH]``. It writes
``results/peak.json`` and the page's picture, ``docs/peak-timeline.svg``, from which
``python -m benchmarks.docs`` renders the report and the costs in docs/memory.md. It reports one
training step of the page's model (four converted ``nn.TransformerEncoderLayer`` regions
between two linear layers, AdamW, batch 8 x 128 tokens, 2 threads), taken after a first
step (whose every region is verified bit for bit, and whose optimizer state is new), then
the step time plainly, under ``measure_peak`` and under ``peak_report``: paired ratios to
``measure_peak`` over ``--rounds`` interleaved rounds (``timing.paired``: median and 95 %
interval), on that model and on a small one whose ops are cheap, where the per-op cost
shows most (8 converted blocks of Linear(256, 256), BatchNorm1d, GELU, Dropout, each a
region; batch 512). ``--html`` also writes the page ``report.save_html`` writes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

import scopedckpt
from benchmarks import ROOT, THREADS, timing
from benchmarks.internals import timeline_svg
from benchmarks.tables import Results, interval, table

PICTURE = ROOT / "docs" / "peak-timeline.svg"


def model_and_step() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """The page's model, its optimizer, and one training step of it."""
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True) for _ in range(4)]
    model = scopedckpt.convert(
        nn.Sequential(nn.Linear(256, 512), nn.Sequential(*layers), nn.Linear(512, 10))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 128, 256)

    def step() -> None:
        with scopedckpt.checkpointing(*model[1]):  # each encoder layer is a region
            loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step


def small_model_and_step() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """The small model of cheap ops, its optimizer, and one training step of it."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.GELU(), nn.Dropout(0.1))
        for _ in range(8)
    ]
    model = scopedckpt.convert(nn.Sequential(*blocks))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(512, 256)

    def step() -> None:
        with scopedckpt.checkpointing(*model):
            loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step


def overhead(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], None], rounds: int
) -> dict[str, list[float]]:
    """Seconds of one step plainly, under measure_peak and under peak_report, per round."""
    runs: dict[str, Callable[[], object]] = {
        "plain step": step,
        "measure_peak(step)": lambda: scopedckpt.measure_peak(step),
        "peak_report(step)": lambda: scopedckpt.peak_report(step, root=model, optimizer=optimizer),
    }
    return timing.interleaved_rounds(runs, calls=1, rounds=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--html", help="write report.save_html(...) here too")
    options = parser.parse_args()
    torch.set_num_threads(THREADS)
    model, optimizer, step = model_and_step()
    step()  # the first step: every region verified, the optimizer's state made
    report = scopedckpt.peak_report(step, root=model, optimizer=optimizer)
    print(report)
    if options.html:
        report.save_html(options.html)
    # A file of its own names the XML namespace that a page's inline picture leaves implicit.
    picture = timeline_svg(report.timeline, report.phases, report.op_index)
    xmlns = '<svg xmlns="http://www.w3.org/2000/svg" '
    PICTURE.write_text(picture.replace("<svg ", xmlns, 1) + "\n")
    timed = {"transformer": overhead(model, optimizer, step, options.rounds)}
    small, small_optimizer, small_step = small_model_and_step()
    small_step()
    timed["small"] = overhead(small, small_optimizer, small_step, options.rounds)
    rows = [
        {"model": name, "variant": variant, "rounds": len(times[variant]),
         "ratio": timing.paired(times, variant, "measure_peak(step)")}
        for name, times in timed.items()
        for variant in ("plain step", "peak_report(step)")
    ]  # fmt: skip
    here = str(ROOT) + "/"  # paths below the repository, relative: the same in any clone
    data = {**report.to_dict(), "source": report.source.replace(here, "")}
    extra = {"report": data, "text": str(report).replace(here, ""), "picture": PICTURE.name}
    timing.save_paired_results("peak", rows, THREADS, options.rounds < 15, extra)
    for row in rows:
        print(row["model"], row["variant"], "/ measure_peak:", row["ratio"])


def report_text(results: Results) -> list[str]:
    """docs/memory.md's report, as printed."""
    data = results["peak"]
    return [f"Output (torch {data['torch']}, CPU, {data['threads']} threads):", "", "```text",
            *data["text"].splitlines(), "```"]  # fmt: skip


def costs(results: Results) -> list[str]:
    """docs/memory.md's cost table: time per step relative to measure_peak's, paired."""
    header = ["model", "step", "× `measure_peak(step)`, median (95 % interval)", "rounds"]
    rows = [
        [_MODELS[r["model"]], f"`{r['variant']}`",
         f"{r['ratio'][0]:.3f} ({interval(r['ratio'][1:])})", r["rounds"]]
        for r in results["peak"]["rows"]
    ]  # fmt: skip
    return table(header, rows, left=2)


_MODELS = {"transformer": "the transformer above", "small": "8 regions of cheap ops"}
TABLES = {"peak-report": report_text, "peak-cost": costs}


if __name__ == "__main__":
    main()
