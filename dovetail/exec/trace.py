"""The Trace: what ran where and when. Both executors emit it; metrics, Chrome traces and Gantt charts
are read from it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Span:
    """One node (or one segment of a migrated node) on one device."""

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


@dataclass
class Trace:
    devices: int
    spans: list[Span] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    peak_memory_gb: list[float] = field(default_factory=list)

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
        }

    @classmethod
    def from_json(cls, data: dict) -> Trace:
        return cls(
            devices=data["devices"],
            spans=[Span(**s) for s in data["spans"]],
            switches=[Switch(**s) for s in data["switches"]],
            steps=[StepRecord(**s) for s in data["steps"]],
            peak_memory_gb=list(data["peak_memory_gb"]),
        )

    def write_chrome(self, path: str | Path) -> None:
        """Chrome trace event format: one row per device; opens in Perfetto or chrome://tracing."""
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
        for s in self.switches:
            events.append(
                {
                    "ph": "X",
                    "pid": 0,
                    "tid": s.device,
                    "cat": "switch",
                    "name": f"switch->{s.role}",
                    "ts": s.start * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": {},
                }
            )
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))

    def write_gantt(self, path: str | Path, title: str = "") -> None:
        """A PNG of `gantt_figure`."""
        import matplotlib.pyplot as plt

        fig = self.gantt_figure(title)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)

    def gantt_figure(self, title: str = ""):
        """One row per device, a colour per node kind (hatched white: role switches), a dotted line at every
        optimizer step (commit). With several pipelines each has a lane of every device's row and a hatching of its
        own, so a kind keeps its colour whichever pipeline ran it. The legend sits below the axes, off the bars."""
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
        fig, ax = plt.subplots(figsize=(12, 0.35 * self.devices * max(1, len(pipelines)) + 1.8), layout="constrained")
        rows: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
        for s in self.spans:
            rows.setdefault((s.pipeline, s.kind, s.device), []).append((s.start, s.end - s.start))
        for (pipeline, kind, device), bars in rows.items():
            top = device + pipelines.index(pipeline) * lane - 0.4
            ax.broken_barh(
                bars, (top, lane), facecolor=colours[kind], edgecolor="black", linewidth=0.2, hatch=hatches[pipeline]
            )
        for s in self.switches:
            ax.broken_barh(
                [(s.start, s.end - s.start)], (s.device - 0.4, 0.8), facecolor="white", edgecolor="grey", hatch="//"
            )
        for commit in sorted({record.end for record in self.steps}):
            ax.axvline(commit, color="black", linestyle=":", linewidth=0.8)
        handles = [Patch(facecolor=colours[k], label=k) for k in kinds]
        if len(pipelines) > 1:
            handles += [Patch(facecolor="white", edgecolor="black", hatch=hatches[p], label=p) for p in pipelines]
        if self.switches:
            handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="role switch"))
        if self.steps:
            handles.append(Line2D([], [], color="black", linestyle=":", label="optimizer step"))
        ax.set_xlabel("seconds")
        ax.set_ylabel("device")
        ax.set_yticks(range(self.devices))
        ax.invert_yaxis()
        ax.set_title(title)
        fig.legend(handles=handles, loc="outside lower center", fontsize="small", ncols=min(len(handles), 8))
        return fig


PIPELINE_HATCHES = ["", "..", "xx", "\\\\", "--", "oo"]
"""Each pipeline's hatching in a Gantt chart ("//" is a role switch's)."""
