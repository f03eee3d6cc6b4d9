"""Metrics read from a Trace: throughput, efficiency, bubbles, staleness, latency, memory, phases.

Efficiency = ideal step time / actual, where ideal = the exclusive device-seconds of the required work (each
node's work as the device would do it alone at full speed: `Span.work`; interference slowdowns, role
switches, a migration's re-prefill delay and idle time excluded) divided by the number of devices. 1.0 means
no device ever waited or switched; co-located nodes that slow each other down by less than their number
(complementary sub-stages under the interference table) do more than one device-second of exclusive work
per device-second, and efficiency then exceeds 1 by what multiplexing gains. A device is busy while anything runs on it,
whatever share that node reserved; bubble = neither busy nor switching."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from dovetail.exec.trace import Trace


@dataclass(frozen=True)
class Metrics:
    makespan_s: float
    steps: int
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    efficiency: float
    bubble_ratio: float
    switch_ratio: float
    busy_ratio_per_device: list[float]
    bubble_ratio_per_device: list[float]
    max_staleness: int
    staleness_histogram: dict[int, int]
    """Staleness (versions) -> number of samples trained with it."""
    step_latency_s: dict[str, float]
    """Mean time from a step's first node to its optimizer step, per pipeline."""
    peak_memory_gb: float
    peak_memory_gb_per_device: list[float]
    phase_seconds: dict[str, float]
    """Device-seconds per node kind (and `switch`) divided by devices: wall time when phases don't overlap."""

    def to_json(self) -> dict:
        return asdict(self)


def summarize(trace: Trace) -> Metrics:
    if not trace.steps:
        raise ValueError("the trace has no committed step; nothing to measure")
    devices = trace.devices
    makespan = trace.makespan
    intervals: list[list[tuple[float, float]]] = [[] for _ in range(devices)]
    switching = [0.0] * devices
    phases: Counter[str] = Counter()
    for span in trace.spans:
        intervals[span.device].append((span.start, span.end))
        phases[span.kind] += span.work / devices
    for switch in trace.switches:
        switching[switch.device] += switch.end - switch.start
        phases["switch"] += (switch.end - switch.start) / devices
    staleness: Counter[int] = Counter()
    latency: dict[str, list[float]] = {}
    for record in trace.steps:
        staleness[record.step - record.rollout_version] += record.samples
        latency.setdefault(record.pipeline, []).append(record.end - record.start)
    steps_per_pipeline = max(len(values) for values in latency.values())
    busy = [_covered(spans) for spans in intervals]
    busy_ratio = [b / makespan for b in busy]
    bubble = [max(0.0, 1.0 - (b + s) / makespan) for b, s in zip(busy, switching)]
    return Metrics(
        makespan_s=makespan,
        steps=len(trace.steps),
        step_time_s=makespan / steps_per_pipeline,
        samples_per_s=sum(r.samples for r in trace.steps) / makespan,
        tokens_per_s=sum(r.tokens for r in trace.steps) / makespan,
        efficiency=sum(span.work for span in trace.spans) / (devices * makespan),
        bubble_ratio=sum(bubble) / devices,
        switch_ratio=sum(switching) / (devices * makespan),
        busy_ratio_per_device=busy_ratio,
        bubble_ratio_per_device=bubble,
        max_staleness=max(staleness),
        staleness_histogram=dict(sorted(staleness.items())),
        step_latency_s={p: sum(v) / len(v) for p, v in sorted(latency.items())},
        peak_memory_gb=max(trace.peak_memory_gb),
        peak_memory_gb_per_device=list(trace.peak_memory_gb),
        phase_seconds=dict(sorted(phases.items())),
    )


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def time_per_step(trace) -> float:
    """Seconds from the start to the last optimizer step, per step: what the simulator must predict
    (the run's final publish and evaluation come after it)."""
    return max(record.end for record in trace.steps) / len(trace.steps)
