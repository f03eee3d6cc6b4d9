"""Metrics pinned to their closed forms on a hand-made schedule: a device is busy while anything runs on
it (whatever share the node reserved), and efficiency counts exclusive device-seconds of required work."""

import json

import pytest

from dovetail.graph.node import Graph, Kind, Node, Role
from dovetail.plan.metrics import summarize
from dovetail.plan.sim import SimExecutor
from dovetail.plan.trace import Segment, Span, StepRecord, Switch, Trace
from dovetail.sched.policy import Begin, Engines, Policy, Run, Setup, StartStep

SLOWDOWN = 1.6


class Scripted(Policy):
    """Starts the step, then runs each ready node where `placement` says, with the given share."""

    name = "scripted"

    @classmethod
    def shape(cls, spec, devices, trainer_devices, cost):
        raise NotImplementedError("runs hand-built graphs only")

    def __init__(self, setup: Setup, placement: dict[str, tuple[tuple[int, ...], float]]) -> None:
        super().__init__(setup)
        self.placement = placement

    def decide(self, view, events):
        if any(isinstance(e, Begin) for e in events):
            return [StartStep("p", 0, 0)]
        return [Run(node, *self.placement[node]) for node in view.ready]


def node(name: str, cost: float, deps: tuple[str, ...] = (), kind: Kind = Kind.DECODE, **extra) -> Node:
    return Node(name, "p", 0, kind, Role.ANY, deps, cost_s=cost, exclusive=False, **extra)


def test_busy_bubble_and_efficiency_follow_their_closed_forms():
    # Device 0: a and b share it (each slowed by SLOWDOWN); device 1: c alone on a 0.3 share, then the
    # collective d on both devices. The commit closes the step.
    a, b, c, d = 4.0, 6.0, 3.0, 2.0
    graph = Graph(
        [
            node("a", a),
            node("b", b),
            node("c", c, kind=Kind.TRAIN),
            node("d", d, ("a", "b", "c"), kind=Kind.PUBLISH, collective=True),
            Node("commit", "p", 0, Kind.COMMIT, Role.ANY, ("d",), cost_s=0.0),
        ]
    )
    setup = Setup(2, 80.0, {"p": Engines({}, {}, {})})
    placement = {"a": ((0,), 0.5), "b": ((0,), 0.5), "c": ((1,), 0.3), "d": ((0, 1), 1.0), "commit": ((0,), 1.0)}
    trace = SimExecutor(graph, setup, slowdown=lambda kind, other: SLOWDOWN).run(Scripted(setup, placement))
    metrics = summarize(trace)

    # a and b run together at 1/SLOWDOWN until a is done; b finishes alone at full speed.
    a_ends = a * SLOWDOWN
    b_ends = a_ends + (b - a)
    makespan = b_ends + d
    assert metrics.makespan_s == pytest.approx(makespan)
    assert metrics.busy_ratio_per_device == pytest.approx([1.0, (c + d) / makespan])
    assert metrics.bubble_ratio_per_device == pytest.approx([0.0, 1 - (c + d) / makespan])
    assert metrics.bubble_ratio == pytest.approx((1 - (c + d) / makespan) / 2)
    # Required work: each node's exclusive device-seconds, on each device at most its busy time: device 0 did
    # a + b + d > makespan (a and b slow each other by less than 2x) and counts its whole makespan once.
    assert a + b + d > makespan
    assert metrics.efficiency == pytest.approx((makespan + c + d) / (2 * makespan))
    assert metrics.phase_seconds == pytest.approx({"decode": (a + b) / 2, "train": c / 2, "publish": d, "commit": 0.0})


def test_efficiency_is_at_most_one_when_co_located_work_does_not_slow_down():
    """Two nodes sharing one device without interference do two device-seconds of exclusive work a second: the
    device was never idle, and efficiency is 1, not 2."""
    graph = Graph(
        [node("a", 3.0), node("b", 3.0), Node("commit", "p", 0, Kind.COMMIT, Role.ANY, ("a", "b"), cost_s=0.0)]
    )
    setup = Setup(1, 80.0, {"p": Engines({}, {}, {})})
    placement = {"a": ((0,), 0.5), "b": ((0,), 0.5), "commit": ((0,), 1.0)}
    trace = SimExecutor(graph, setup, slowdown=lambda kind, other: 1.0).run(Scripted(setup, placement))
    assert trace.makespan == pytest.approx(3.0) and sum(s.work for s in trace.spans) == pytest.approx(6.0)
    assert summarize(trace).efficiency == pytest.approx(1.0)


def test_the_steady_step_is_the_time_between_commits_after_the_first():
    """Commits at 10 s, 14 s and 18 s (a first step with nothing to overlap, then 4 s a step): the steady step is
    4 s, the first step 10 s, and makespan / steps (6 s) overstates the step a long run settles to."""
    trace = Trace(devices=1, spans=[Span("n", "p", 0, "train", 0, 0.0, 18.0, 1.0, 0)], peak_memory_gb=[1.0])
    trace.steps = [StepRecord("p", step, step, start, end, 8, 0) for step, (start, end) in enumerate(COMMITS)]
    metrics = summarize(trace)
    assert (metrics.first_step_s, metrics.steady_step_s, metrics.step_time_s) == (10.0, 4.0, 6.0)


COMMITS = [(0.0, 10.0), (6.0, 14.0), (10.0, 18.0)]
"""(start, end) of three steps: the first alone, then one every 4 s."""


def test_the_gantt_chart_tells_pipelines_apart_marks_steps_and_keeps_its_legend_off_the_bars():
    """Two pipelines on two devices, busy to the end of the chart: each kind one colour in both pipelines, each
    pipeline a hatching of its own, a line at every commit, and the legend below the axes, where no bar is."""
    from matplotlib.colors import to_rgba
    from matplotlib.lines import Line2D

    spans = [
        Span(f"{p}/{kind}{d}", p, 0, kind, d, start, start + 1.0, 0.5, 0)
        for p in ("sort", "digits")
        for d in (0, 1)
        for kind, start in (("generate", 0.0), ("train", 1.0), ("generate", 2.0))
    ]
    steps = [StepRecord(p, 0, 0, 0.0, end, 4, 0) for p, end in (("sort", 2.0), ("digits", 2.5))]
    figure = Trace(devices=2, spans=spans, steps=steps, peak_memory_gb=[1.0, 1.0]).gantt_figure("two pipelines")
    (ax,) = figure.axes
    bars = {(to_rgba(c.get_facecolor()[0]), c.get_hatch()) for c in ax.collections}
    colours = {colour for colour, _ in bars}
    assert len(colours) == 2 and len({hatch for _, hatch in bars}) == 2 and len(bars) == 4
    commits = sorted(line.get_xdata()[0] for line in ax.lines if isinstance(line, Line2D))
    assert commits == [2.0, 2.5]
    figure.canvas.draw()
    (legend,) = (legend.get_window_extent() for legend in figure.legends)
    assert legend.y1 <= ax.get_window_extent().y0  # wholly below the axes


def test_environment_waits_have_a_row_per_pipeline_below_the_devices_in_the_gantt_chart_and_the_chrome_trace(
    tmp_path,
):
    """A wait holds no device: pipeline a's two overlapping waits and b's one are drawn in a row of each pipeline's
    below the two devices' rows, each bar where its wait is, in a look no node kind or pipeline has, and named in the
    legend; the Chrome trace gives each pipeline's waits a thread of their own after the devices'."""
    from matplotlib.colors import to_rgba

    from dovetail.plan.trace import WAIT_LABEL, Wait

    spans = [Span(f"{p}/decode{d}", p, 0, "decode", d, 0.0, 1.0, 0.5, 0) for p in ("a", "b") for d in (0, 1)]
    waits = [
        Wait("a/0/env/0/0", "a", 0, 1.0, 3.0),
        Wait("a/0/env/1/0", "a", 0, 1.5, 2.5),
        Wait("b/0/env/0/0", "b", 0, 1.0, 4.0),
    ]
    trace = Trace(devices=2, spans=spans, peak_memory_gb=[1.0, 1.0], waits=waits)
    (ax,) = trace.gantt_figure().axes
    assert [label.get_text() for label in ax.get_yticklabels()] == ["0", "1", "a waits", "b waits"]
    assert list(ax.get_yticks()) == [0, 1, 2, 3]
    drawn = {}
    for collection in ax.collections:
        for path in collection.get_paths():
            box = path.get_extents()
            drawn.setdefault(round(box.y0 + box.height / 2), []).append((box.x0, box.width, collection))  # its row
    assert sorted(drawn) == [0, 1, 2, 3]  # the devices' rows, then a's waits and b's
    for row, pipeline in ((2, "a"), (3, "b")):
        expected = sorted((w.start, w.end - w.start) for w in waits if w.pipeline == pipeline)
        assert sorted((x, pytest.approx(width)) for x, width, _ in drawn[row]) == expected
    wait_looks = {(to_rgba(c.get_facecolor()[0]), c.get_hatch()) for row in (2, 3) for *_, c in drawn[row]}
    kind_looks = {(to_rgba(c.get_facecolor()[0]), c.get_hatch()) for row in (0, 1) for *_, c in drawn[row]}
    assert len(wait_looks) == 1 and not wait_looks & kind_looks
    assert {to_rgba(c.get_facecolor()[0])[:3] for row in (0, 1) for *_, c in drawn[row]}.isdisjoint(
        {colour[:3] for colour, _ in wait_looks}
    )
    (legend,) = trace.gantt_figure().legends
    assert WAIT_LABEL in [text.get_text() for text in legend.get_texts()]
    trace.write_chrome(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {0: "device 0", 1: "device 1", 2: "a waits", 3: "b waits"}
    waited = sorted((e["tid"], e["ts"], e["dur"], e["args"]["node"]) for e in events if e.get("cat") == "env")
    assert waited == [
        (2, 1.0e6, 2.0e6, "a/0/env/0/0"),
        (2, 1.5e6, 1.0e6, "a/0/env/1/0"),
        (3, 1.0e6, 3.0e6, "b/0/env/0/0"),
    ]
    without = Trace(devices=2, spans=spans, peak_memory_gb=[1.0, 1.0]).gantt_figure().axes[0]
    assert [label.get_text() for label in without.get_yticklabels()] == ["0", "1"]  # no waits, no rows of them


def test_a_run_that_went_on_without_a_device_is_one_trace_on_the_run_s_clock_steps_and_devices(tmp_path):
    """Two stretches of a run: steps 0-1 on devices 0-2, then (device 1 lost) steps from 2 on the two left, whose
    indices in the second pool are 0 and 1. The whole trace puts every span on the first stretch's clock, the run's
    step and the run's device, keeps each device's peak memory, and marks where the second stretch began."""
    first = Trace(
        devices=3,
        spans=[Span(f"g{d}", "p", s, "generate", d, s, s + 0.5, 1.0, s) for s in (0, 1) for d in range(3)],
        steps=[StepRecord("p", s, s, s, s + 1.0, 8, 0) for s in (0, 1)],
        peak_memory_gb=[1.0, 2.0, 3.0],
    )
    second = Trace(
        devices=2,
        spans=[Span(f"t{d}", "p", 0, "train", d, 0.25, 0.75, 1.0, 2) for d in range(2)],
        switches=[Switch(1, 0.0, 0.25, "trainer")],
        steps=[StepRecord("p", 0, 2, 0.0, 1.0, 8, 0)],
        peak_memory_gb=[4.0, 0.5],
    )
    why = "lost device 1: going on from step 2 on the 2 devices left under digen"
    whole = Trace.of_segments(
        [Segment(first, 100.0, 0, (0, 1, 2), "began on 3 devices"), Segment(second, 110.0, 2, (0, 2), why)], 3
    )
    later = [s for s in whole.spans if s.kind == "train"]
    assert [(s.device, s.step, s.start, s.end) for s in later] == [(0, 2, 10.25, 10.75), (2, 2, 10.25, 10.75)]
    assert whole.spans[: len(first.spans)] == first.spans
    assert [(s.device, s.start) for s in whole.switches] == [(2, 10.0)]
    assert [(r.step, r.end) for r in whole.steps] == [(0, 1.0), (1, 2.0), (2, 11.0)]
    assert whole.peak_memory_gb == [4.0, 2.0, 3.0]
    assert [(m.time, m.label) for m in whole.marks] == [(10.0, why)]
    whole.write_chrome(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert [(e["name"], e["ts"]) for e in events if e["ph"] == "i"] == [(why, 10.0e6)]
    assert Trace.from_json(whole.to_json()) == whole
    (ax,) = whole.gantt_figure().axes
    assert 10.0 in [line.get_xdata()[0] for line in ax.lines]


def test_the_replayed_step_time_of_a_multiplexed_run_is_per_step_of_a_pipeline():
    """Two pipelines of two steps each, the last commit at 5 s: 2.5 s a step, not 5 s over all four commits."""
    from dovetail.plan.metrics import time_per_step

    spans = [Span("n", "p", 0, "train", 0, 0.0, 6.0, 1.0, 0)]  # the final publish ends after the last commit
    steps = [
        StepRecord(p, i, i, 0.0, end, 4, 0)
        for p, ends in (("p", (2.0, 4.0)), ("q", (3.0, 5.0)))
        for i, end in enumerate(ends)
    ]
    trace = Trace(devices=1, spans=spans, steps=steps, peak_memory_gb=[1.0])
    assert time_per_step(trace) == 2.5 and summarize(trace).step_time_s == 3.0
