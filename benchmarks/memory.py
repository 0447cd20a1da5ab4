"""Memory a training step takes, by configuration: peak RSS, peak heap in use, and what measuring costs.

* :func:`peak_rss_mib`: what the first step adds to the resident set, in a fresh
  subprocess per configuration (Linux ``VmHWM`` after resetting it). Kept for
  comparison only: glibc's dynamic mmap threshold decides how many freed pages stay
  resident, so RSS follows the allocation history, not the bytes in use.
* :func:`peak_heap_mib`: the most heap bytes in use at any aten-op boundary of a step
  (:mod:`benchmarks.heap`), after a warm-up step.
* :func:`measurement_overheads`: step time of (c) with the heap sampler, and with
  ``scopedckpt.memory_report()`` open, over without.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import scopedckpt

from . import ROOT, heap, models
from .timing import interleaved_rounds, paired


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def step_peak_mib(kind: str, depth: int, config: str) -> float:
    """Run in a fresh process: peak RSS of one step above the RSS before it (Linux)."""
    model, x = models.build(kind, depth, config)
    # The first step: later ones reuse heap pages freed by earlier ones, which
    # hides their peak from RSS.
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    before = _status_kib("VmRSS")
    models.step(model, x)
    return (_status_kib("VmHWM") - before) / 1024


def peak_rss_mib(kind: str, depth: int, config: str) -> float:
    """Peak resident memory a training step adds, each configuration in its own subprocess."""
    code = (
        "from benchmarks.memory import step_peak_mib; "
        f"print(step_peak_mib({kind!r}, {depth}, {config!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return float(out.stdout.strip().splitlines()[-1])


def peak_heap_mib(kind: str, depth: int, config: str) -> float:
    """Peak heap bytes in use during a step (after a warm-up step), above those before it."""
    model, x = models.build(kind, depth, config)
    models.step(model, x)
    return heap.peak_in_use(lambda: models.step(model, x)) / 2**20


def measurement_overheads(kind: str, depth: int, repeats: int) -> dict[str, float]:
    """What measuring costs (c): the heap sampler, and scopedckpt.memory_report()."""
    model, x = models.build(kind, depth, "c")
    models.step(model, x)

    def reported() -> None:
        with scopedckpt.memory_report():
            models.step(model, x)

    # Interleaved rounds on one model (two instances of a model differ by as much as
    # is measured here), four times as many as the step-time table's, paired.
    times = interleaved_rounds(
        {"plain": lambda: models.step(model, x), "reported": reported},
        calls=1,
        rounds=4 * repeats,
    )
    median, low, high = paired(times, "reported", "plain")
    return {
        "heap sampler": heap.sampling_overhead(lambda: models.step(model, x), repeats),
        "memory_report": median,
        "memory_report 95% interval low": low,
        "memory_report 95% interval high": high,
    }
