"""Step times with each configuration in its own process, timed in interleaved rounds.

Used by :mod:`benchmarks.run` for the step-time table. Why processes: in one process, a
configuration's step meets the heap the others left behind. glibc hands large blocks
back to the kernel (its dynamic mmap threshold, and trimming the top of the heap)
depending on the order and sizes of earlier frees, and every page it hands back faults
again when touched, so a cell's ratios would depend on which cells and configurations
ran before it. A worker per configuration keeps each heap to its own steps, as in real
training, while the rounds stay interleaved, so that the machine's drift still hits
every configuration alike. Each timed step's minor page faults are reported with it.

The workers live for the whole sweep, each building every cell's model in turn (so a
sweep pays one process start-up per configuration, not per cell). Each turn runs
``STEPS_PER_TURN`` steps back to back and keeps the last one's time: the first step of
a turn finds the caches full of another process's data, which depends on the other
configurations again.
"""

from __future__ import annotations

import multiprocessing
import resource
import time
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

# The last of these steps is timed: the ones before it warm the caches.
STEPS_PER_TURN = 2


def _serve(conn: Connection, config: str, threads: int) -> None:
    """A worker: build models of one configuration and step them when told to."""
    import torch

    from . import models

    torch.set_num_threads(threads)
    built: Any = None
    while (message := conn.recv()) is not None:
        if message[0] == "build":
            built = None  # free the last cell's model first
            built = models.build(message[1], message[2], config)
            models.step(*built)  # warm-up
            facts = {
                "saved_bytes": models.saved_bytes(*built),
                "dropouts": models.dropouts(built[0]),
            }
            conn.send(facts)
            continue
        for _ in range(message[1]):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            models.step(*built)
            seconds = time.perf_counter() - start
        conn.send((seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))


class StepWorkers:
    """One worker process per configuration, alive for a sweep of cells.

    Example
    -------
    >>> with StepWorkers(("a", "b"), threads=2) as workers:  # doctest: +SKIP
    ...     times, faults, facts = workers.rounds("mlp", 8, rounds=21)
    """

    def __init__(self, configs: tuple[str, ...], threads: int) -> None:
        self.configs = configs
        self.threads = threads
        self._conns: dict[str, Connection] = {}
        self._processes: list[Any] = []

    def __enter__(self) -> StepWorkers:
        context = multiprocessing.get_context("spawn")  # no forked torch state
        for config in self.configs:
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child, config, self.threads))
            process.start()
            self._conns[config] = parent
            self._processes.append(process)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for conn in self._conns.values():
            try:
                conn.send(None)
            except OSError:  # that worker has gone
                pass
        for process in self._processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()

    def rounds(
        self, kind: str, depth: int, rounds: int
    ) -> tuple[dict[str, list[float]], dict[str, list[int]], dict[str, dict[str, int]]]:
        """Seconds and minor page faults of each configuration's timed step in every
        round, and facts about each model, from the worker that built it: the bytes it
        saves for backward (``saved_bytes``) and its dropout layers (``dropouts``).

        Only one worker steps at a time, in rotating order (as
        ``timing.interleaved_rounds``).
        """
        conns = self._conns
        for config in self.configs:
            conns[config].send(("build", kind, depth))
        facts = {config: conns[config].recv() for config in self.configs}
        for config in self.configs:  # one more turn each, untimed
            conns[config].send(("steps", STEPS_PER_TURN))
            conns[config].recv()
        times: dict[str, list[float]] = {config: [] for config in self.configs}
        faults: dict[str, list[int]] = {config: [] for config in self.configs}
        names = list(self.configs)
        for r in range(rounds):
            shift = r % len(names)
            for config in names[shift:] + names[:shift]:
                conns[config].send(("steps", STEPS_PER_TURN))
                seconds, minor = conns[config].recv()
                times[config].append(seconds)
                faults[config].append(minor)
        return times, faults, facts
