"""The Trace: what ran where and when. Both executors emit it; metrics, Chrome traces and Gantt charts
are read from it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path


@dataclass(slots=True, unsafe_hash=True)
class Span:
    """One node (or one segment of a migrated node) on one device. Never changed once made (`dataclasses.replace`
    makes another), but not frozen: a frozen dataclass's `__init__` sets each field through `object.__setattr__`,
    about ten times the cost of a plain one, and the simulator makes a span per device of every node it runs (a
    trainer node on a 256-device pool: 256)."""

    node: str
    pipeline: str
    step: int
    kind: str
    device: int
    start: float
    end: float
    share: float
    version: int
    """Weights version the work used: the step's rollout version for generation, the trainer's for training."""
    work: float = 0.0
    """Exclusive device-seconds of node work the span did on this device: how long that work takes the device
    alone at full speed (interference, waits and a migration's re-prefill delay excluded)."""


@dataclass(frozen=True, slots=True)
class Switch:
    device: int
    start: float
    end: float
    role: str


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One committed step: when its first node started, when its optimizer step ended, what it held."""

    pipeline: str
    step: int
    rollout_version: int
    start: float
    end: float
    samples: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Wait:
    """One environment wait (an env node): its trajectories waited on their environment from `start` to `end`,
    holding no device (whatever ran on the devices meanwhile is in the spans)."""

    node: str
    pipeline: str
    step: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Mark:
    """A moment of the run worth a line in the charts: where it went on without a lost device, and why."""

    time: float
    label: str


@dataclass
class Trace:
    devices: int
    spans: list[Span] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    peak_memory_gb: list[float] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)

    @classmethod
    def of_segments(cls, segments: Sequence[Segment], devices: int) -> Trace:
        """One trace of a run that went on without lost devices: each segment's spans, switches and steps moved to
        the run's clock, steps and devices (the `devices` of the pool it began with), and a mark where each later
        segment began."""
        whole = cls(devices=devices, peak_memory_gb=[0.0] * devices)
        for segment in segments:
            trace, at, device_of = segment.trace, segment.start - segments[0].start, segment.devices
            moved = partial(_later, by=at)
            whole.spans += [moved(s, device=device_of[s.device], step=s.step + segment.first_step) for s in trace.spans]
            whole.switches += [moved(s, device=device_of[s.device]) for s in trace.switches]
            whole.steps += [moved(s, step=s.step + segment.first_step) for s in trace.steps]
            for device, peak in enumerate(trace.peak_memory_gb):
                whole.peak_memory_gb[device_of[device]] = max(whole.peak_memory_gb[device_of[device]], peak)
            if segment is not segments[0]:
                whole.marks.append(Mark(at, segment.label))
        return whole

    @property
    def makespan(self) -> float:
        ends = [s.end for s in self.spans] + [s.end for s in self.switches]
        return max(ends, default=0.0)

    def to_json(self) -> dict:
        return {
            "devices": self.devices,
            "spans": [asdict(s) for s in self.spans],
            "switches": [asdict(s) for s in self.switches],
            "steps": [asdict(s) for s in self.steps],
            "peak_memory_gb": self.peak_memory_gb,
            "marks": [asdict(m) for m in self.marks],
            "waits": [asdict(w) for w in self.waits],
        }

    @classmethod
    def from_json(cls, data: dict) -> Trace:
        return cls(
            devices=data["devices"],
            spans=[Span(**s) for s in data["spans"]],
            switches=[Switch(**s) for s in data["switches"]],
            steps=[StepRecord(**s) for s in data["steps"]],
            peak_memory_gb=list(data["peak_memory_gb"]),
            marks=[Mark(**m) for m in data.get("marks", [])],  # traces written before marks existed have none
            waits=[Wait(**w) for w in data.get("waits", [])],  # nor before environment waits did
        )

    def waiting_pipelines(self) -> list[str]:
        """The pipelines whose trajectories waited on their environment, in order of name: each has a row of its
        waits below the devices' in the charts, since a wait holds no device."""
        return sorted({wait.pipeline for wait in self.waits})

    def write_chrome(self, path: str | Path) -> None:
        """Chrome trace event format: one row per device, then one per pipeline of its environment waits; opens in
        Perfetto or chrome://tracing."""
        events: list[dict] = [
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": d, "args": {"name": f"device {d}"}}
            for d in range(self.devices)
        ]
        for s in self.spans:
            events.append(
                {
                    "ph": "X",
                    "pid": 0,
                    "tid": s.device,
                    "cat": s.kind,
                    "name": f"{s.pipeline}:{s.kind}",
                    "ts": s.start * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": {"node": s.node, "step": s.step, "version": s.version, "share": s.share},
                }
            )
        for switch in self.switches:
            events.append(
                {
                    "ph": "X",
                    "pid": 0,
                    "tid": switch.device,
                    "cat": "switch",
                    "name": f"switch->{switch.role}",
                    "ts": switch.start * 1e6,
                    "dur": (switch.end - switch.start) * 1e6,
                    "args": {},
                }
            )
        waiting = self.waiting_pipelines()
        for row, pipeline in enumerate(waiting, start=self.devices):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": 0, "tid": row, "args": {"name": f"{pipeline} waits"}}
            )
        for wait in self.waits:
            events.append(
                {
                    "ph": "X",
                    "pid": 0,
                    "tid": self.devices + waiting.index(wait.pipeline),
                    "cat": "env",
                    "name": f"{wait.pipeline}:env",
                    "ts": wait.start * 1e6,
                    "dur": (wait.end - wait.start) * 1e6,
                    "args": {"node": wait.node, "step": wait.step},
                }
            )
        events += [{"ph": "i", "s": "g", "pid": 0, "name": m.label, "ts": m.time * 1e6} for m in self.marks]
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))

    def write_gantt(self, path: str | Path, title: str = "") -> None:
        """A PNG of `gantt_figure`."""
        import matplotlib.pyplot as plt

        fig = self.gantt_figure(title)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)

    def gantt_figure(self, title: str = ""):
        """One row per device, a colour per node kind (hatched white: role switches), a dotted line at every
        optimizer step (commit), a red dashed one at every mark. With several pipelines each has a lane of every
        device's row and a hatching of its own, so a kind keeps its colour whichever pipeline ran it. Environment waits
        hold no device: below the devices, each pipeline that waited has a row of its waits, pale and translucent
        (the waits of a step's shards overlap, darker where more wait at once), so an idle stretch of a device reads
        against the waits that left it idle. The legend sits below the axes, off the bars."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        kinds = sorted({s.kind for s in self.spans})
        pipelines = sorted({s.pipeline for s in self.spans})
        colours = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
        hatches = {p: PIPELINE_HATCHES[j % len(PIPELINE_HATCHES)] for j, p in enumerate(pipelines)}
        lane = 0.8 / max(1, len(pipelines))
        waiting = self.waiting_pipelines()
        height = 0.35 * self.devices * max(1, len(pipelines)) + 0.35 * len(waiting) + 1.8
        fig, ax = plt.subplots(figsize=(12, height), layout="constrained")
        rows: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
        for s in self.spans:
            rows.setdefault((s.pipeline, s.kind, s.device), []).append((s.start, s.end - s.start))
        for (pipeline, kind, device), bars in rows.items():
            top = device + pipelines.index(pipeline) * lane - 0.4
            ax.broken_barh(
                bars, (top, lane), facecolor=colours[kind], edgecolor="black", linewidth=0.2, hatch=hatches[pipeline]
            )
        for switch in self.switches:
            ax.broken_barh(
                [(switch.start, switch.end - switch.start)],
                (switch.device - 0.4, 0.8),
                facecolor="white",
                edgecolor="grey",
                hatch="//",
            )
        for row, pipeline in enumerate(waiting, start=self.devices):
            ax.broken_barh(
                [(w.start, w.end - w.start) for w in self.waits if w.pipeline == pipeline],
                (row - 0.4, 0.8),
                facecolor=WAIT_COLOUR,
                alpha=0.5,
                edgecolor="grey",
                linewidth=0.2,
                hatch=WAIT_HATCH,
            )
        for commit in sorted({record.end for record in self.steps}):
            ax.axvline(commit, color="black", linestyle=":", linewidth=0.8)
        for mark in self.marks:
            ax.axvline(mark.time, color="red", linestyle="--", linewidth=1.2)
        handles: list[Patch | Line2D] = [Patch(facecolor=colours[k], label=k) for k in kinds]
        if len(pipelines) > 1:
            handles += [Patch(facecolor="white", edgecolor="black", hatch=hatches[p], label=p) for p in pipelines]
        if self.switches:
            handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="role switch"))
        if waiting:
            handles.append(
                Patch(facecolor=WAIT_COLOUR, alpha=0.5, edgecolor="grey", hatch=WAIT_HATCH, label=WAIT_LABEL)
            )
        if self.steps:
            handles.append(Line2D([], [], color="black", linestyle=":", label="optimizer step"))
        handles += [Line2D([], [], color="red", linestyle="--", label=mark.label) for mark in self.marks]
        ax.set_xlabel("seconds")
        ax.set_ylabel("device")
        ax.set_yticks(range(self.devices + len(waiting)))
        ax.set_yticklabels([str(d) for d in range(self.devices)] + [f"{p} waits" for p in waiting])
        ax.invert_yaxis()
        ax.set_title(title)
        fig.legend(handles=handles, loc="outside lower center", fontsize="small", ncols=min(len(handles), 8))
        return fig


def _later(record, by: float, **fields):
    """A span, switch or step record `by` seconds later, with `fields` changed."""
    return replace(record, start=record.start + by, end=record.end + by, **fields)


@dataclass(frozen=True)
class Segment:
    """A stretch of a run on one set of devices: its executor's trace, when it began (on a clock all the run's
    segments share), the run's step its step 0 is, the run's device index of each of its devices, and what began it."""

    trace: Trace
    start: float
    first_step: int
    devices: tuple[int, ...]
    label: str


PIPELINE_HATCHES = ["", "..", "xx", "\\\\", "--", "oo"]
"""Each pipeline's hatching in a Gantt chart ("//" is a role switch's, "||" an environment wait's)."""
WAIT_COLOUR = "#c6dbef"
WAIT_HATCH = "||"
WAIT_LABEL = "environment wait (holds no device)"
"""An environment wait's look in a Gantt chart: a pale blue no node kind's tab10 colour is, a hatching no pipeline's
or role switch's is."""
