"""LLM policies on the JigsawRL scenarios: every sample generated and trained exactly once, and the
64-GPU scenario plans in seconds."""

import time
from collections import Counter

import pytest

from dovetail.exec.sim import SimExecutor
from dovetail.graph.node import Kind
from dovetail.scenario import load_scenario, prepare


def run(name: str, policy: str, steps: int):
    prepared = prepare(load_scenario(name), policy, steps=steps)
    return prepared.graph, SimExecutor(prepared.graph, prepared.setup).run(prepared.policy)


@pytest.mark.parametrize("name", ["jigsaw-qwen3-4b-8xh100", "jigsaw-mixed-0.6b-8b"])
def test_verl_sync_generates_and_trains_every_sample_once(name):
    graph, trace = run(name, "verl-sync", steps=2)
    finished = {span.node for span in trace.spans}
    assert finished == set(graph.nodes)
    def per_sample(kind):
        return Counter((n.pipeline, s) for n in graph if n.kind == kind for s in n.samples)

    prefilled, trained = per_sample(Kind.PREFILL), per_sample(Kind.TRAIN)
    assert set(prefilled.values()) == {1} and set(trained.values()) == {1}
    assert set(trained) == set(prefilled) == set(per_sample(Kind.DECODE))
    assert {record.samples for record in trace.steps} == {64 * 4}


def test_one_step_of_the_64_gpu_scenario_simulates_in_under_two_seconds():
    start = time.perf_counter()
    graph, trace = run("jigsaw-64xa100", "verl-sync", steps=1)
    assert time.perf_counter() - start < 2.0
    assert len(trace.steps) == 2
