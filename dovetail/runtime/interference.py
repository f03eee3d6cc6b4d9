"""JigsawRL's interference table, measured on the run's own devices: how much one pipeline's work slows down beside
another pipeline's on one device.

A multiplexed run gives every pipeline a worker process of its own on every device, and the workers of one device
share it (one CPU core, or one GPU). On device 0 (the pool's devices are alike: one keeps the measurement to
seconds), each kind of work the pipelines co-locate is timed alone on its pipeline's worker, then beside each kind
of every other pipeline, both at once on their own workers; a kind's slowdown beside another is its time beside /
its time alone. The table's keys are node kinds (`graph.node.Kind`),
as in `Calibration.interference`: `launch.prepare_run` puts it in every pipeline's cost model, from which the
policy's look-ahead and the simulator take it (`Setup.slowdown`).

The work timed is the start-up profile's (`profile_works` of `pipelines.lm.engines` / `pipelines.flow.engines`), run by
`time_work` on the workers (`DeviceWorker.time_kind`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import ray
import torch
from ray.actor import ActorHandle

from dovetail.config.multiplex import PipelineConfig
from dovetail.graph.flow import split
from dovetail.kinds import kind
from dovetail.models.training import synchronize
from dovetail.runtime.recovery import Started

UNIT_S = 0.2
"""Seconds of work (alone) in one timed repeat: many scheduler time slices, so that two processes taking turns on
one core average out."""
REPEATS = 3
"""Repeats of each timing; a time is their median."""
SAME_PIPELINE = 2.0
"""Slowdown of two kinds of one pipeline beside each other: its worker on a device (a Ray actor) does one piece of
work at a time, so they take turns, which is time slicing."""

Span = tuple[float, float]
"""(start, end) of one run of a piece of work, on the monotonic clock."""


@dataclass
class Side:
    """One kind of one pipeline's work, on the pipeline's device-0 worker."""

    pipeline: str
    kind: str
    worker: ActorHandle
    """The pipeline's DeviceWorker on device 0."""
    samples: int
    run_s: float = 0.0
    """Seconds of one run alone (`time_alone`)."""

    def runs(self, n: int):
        """The worker's spans of `n` runs of this work (`time_work`)."""
        return self.worker.time_kind.remote(self.kind, self.samples, n)

    def repeats_s(self) -> float:
        """Seconds alone of REPEATS repeats of whole runs, each at least UNIT_S."""
        return REPEATS * math.ceil(UNIT_S / self.run_s) * self.run_s


def measure_interference(
    started: dict[str, Started], configs: dict[str, PipelineConfig]
) -> dict[tuple[str, str], float]:
    """(kind, alongside) -> slowdown of `kind` beside `alongside`, for the node kinds each pipeline's kind names
    (`PipelineKind.interference`) of every pipeline of the run. Two kinds of different pipelines are measured; where
    pipelines share a kind name (an LM and a flow pipeline both train) the key gets the mean of what was measured for
    it, and a pair of kinds already measured is not measured again. Two kinds that meet only within one pipeline get
    SAME_PIPELINE: the table is keyed by kind alone, so a measured pair of different pipelines stands also for the
    same pair within one."""
    sides = [
        Side(name, node_kind, started[name].workers[0], config.runtime.profile_samples)
        for name, config in configs.items()
        for node_kind in kind(config.kind).interference
    ]
    for side in sides:
        side.run_s = time_alone(side)
    measured: dict[tuple[str, str], list[float]] = {}
    for a, b in combinations(sides, 2):
        if a.pipeline == b.pipeline or {(a.kind, b.kind), (b.kind, a.kind)} <= measured.keys():
            continue
        slowdown_a, slowdown_b = slowdowns_beside(a, b)
        measured.setdefault((a.kind, b.kind), []).append(slowdown_a)
        measured.setdefault((b.kind, a.kind), []).append(slowdown_b)
    table = {(a.kind, b.kind): SAME_PIPELINE for a in sides for b in sides if a.pipeline == b.pipeline}
    return table | {key: statistics.mean(slowdowns) for key, slowdowns in measured.items()}


def time_alone(side: Side) -> float:
    """Seconds of one run of `side`'s work alone; a probe of two runs (the first warms up) sizes the repeats."""
    start, end = ray.get(side.runs(2))[-1]
    return per_run(ray.get(side.runs(REPEATS * math.ceil(UNIT_S / (end - start)))))


ATTEMPTS = 3
"""Tries at a pair, each twice as long as the last, before it is taken as time slicing (`SAME_PIPELINE`)."""


def slowdowns_beside(a: Side, b: Side) -> tuple[float, float]:
    """The slowdowns of `a` and `b` started at the same moment, each on its own worker, each for as long (alone)
    as the longer of their `repeats_s`. Only the runs that lie wholly inside the time both were running count:
    one side's work before its first run (its inputs), or after the other's last, had the device to itself. A
    machine busy with other work can stretch one side so far that none of its runs fits: then the pair is tried
    again for twice as long, and after ATTEMPTS taken as time slicing rather than stopping the run."""
    seconds = max(a.repeats_s(), b.repeats_s())
    for _ in range(ATTEMPTS):
        spans = ray.get([side.runs(math.ceil(seconds / side.run_s)) for side in (a, b)])
        both = (max(s[0][0] for s in spans), min(s[-1][1] for s in spans))
        inside = [[(start, end) for start, end in runs if both[0] <= start and end <= both[1]] for runs in spans]
        if all(inside):
            return per_run(inside[0]) / a.run_s, per_run(inside[1]) / b.run_s
        seconds *= 2
    return SAME_PIPELINE, SAME_PIPELINE


def per_run(spans: list[Span]) -> float:
    """Seconds per run: the runs cut into REPEATS consecutive groups, the median of the groups' means."""
    groups = [spans[rows.start : rows.stop] for rows in split(len(spans), REPEATS) if rows]
    return statistics.median(sum(end - start for start, end in group) / len(group) for group in groups)


def time_work(works: dict[str, Callable[[dict], object]], kind: str, repeats: int, device: torch.device) -> list[Span]:
    """Each of `repeats` runs of `works[kind]` (a pipeline's start-up profile work, in the order it runs, each
    taking the earlier ones' results by kind), after the works before it have made its inputs, untimed. The spans
    are on the monotonic clock, which the processes of a machine share, so that two workers' runs line up."""
    if kind not in works:
        raise ValueError(f"no profile work of kind {kind!r}; there is {', '.join(works)}")
    done: dict[str, object] = {}
    for name, work in works.items():
        if name == kind:
            break
        done[name] = work(done)
    spans = []
    for _ in range(repeats):
        synchronize(device)
        start = time.monotonic()
        works[kind](done)
        synchronize(device)
        spans.append((start, time.monotonic()))
    return spans
