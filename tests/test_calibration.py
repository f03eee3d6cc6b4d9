"""The calibration scenarios, simulated end to end, land on the published measurements:
step time within 25 % and each published phase's share of the step within 10 percentage points."""

from collections import defaultdict

import pytest

from dovetail.graph.lm import stage
from dovetail.plan.prepare import prepare
from dovetail.plan.scenario import load_scenario
from dovetail.plan.sim import SimExecutor


def simulate(name: str, policy: str):
    scenario = load_scenario(name)
    prepared = prepare(scenario, policy, steps=2)
    return scenario, prepared.graph, SimExecutor(prepared.graph, prepared.setup).run(prepared.policy)


def steady_step_time(trace) -> float:
    """Commit to commit: one whole step including switches and weight sync."""
    ends = sorted(record.end for record in trace.steps)
    return ends[1] - ends[0]


def assert_step_and_phases(published, trace, phase_of) -> None:
    """Step time within 25 %; each published phase's share of step 1 on device 0 within 10 points."""
    step_time = steady_step_time(trace)
    assert step_time == pytest.approx(published.step_time_s, rel=0.25)
    seconds = defaultdict(float)
    for span in trace.spans:
        if span.step == 1 and span.device == 0:
            seconds[phase_of(span)] += span.end - span.start
    for phase, published_s in published.phases_s.items():
        assert seconds[phase] / step_time == pytest.approx(published_s / published.step_time_s, abs=0.10), phase


def test_qwen3_4b_gsm8k_verl_sync_matches_the_published_step():
    scenario, graph, trace = simulate("calib-qwen3-4b-gsm8k", "verl-sync")
    published = scenario.published
    assert_step_and_phases(
        published, trace, lambda span: "generate" if stage(graph[span.node]) == "rollout" else stage(graph[span.node])
    )


def test_qwenimage_colocated_matches_the_published_throughput():
    scenario, _, trace = simulate("calib-qwenimage-4xh200", "colocated")
    step_time = steady_step_time(trace)
    assert step_time == pytest.approx(scenario.published.step_time_s, rel=0.25)
    images_per_gpu_s = trace.steps[1].samples / step_time / scenario.cluster.devices
    assert images_per_gpu_s == pytest.approx(0.510, rel=0.25)


def test_wan22_colocated_matches_the_published_step_and_phases():
    scenario, _, trace = simulate("calib-wan22-colocated", "colocated")
    published = scenario.published
    assert_step_and_phases(published, trace, lambda span: span.kind)
