"""jigsaw and jigsaw-greedy multiplex a flow (text-to-image) pipeline beside a language-model one on one pool, run a
flow pipeline alone, and weigh pipelines by `priority` when their trainer work competes."""

import planner_scenarios
import pytest
from test_sim_properties import check_trace

from dovetail.cost.model import CostModel
from dovetail.graph.flow import FlowShape
from dovetail.graph.node import Kind
from dovetail.kinds import KINDS
from dovetail.plan.prepare import prepare, run_prepared, simulate
from dovetail.sched.jigsaw import SLICED, UNSLICED, Jigsaw, base_shape, on_slice, rollout_shares, sub_pool, turn_of

STEPS = 3


def scenario(*pipelines: dict, devices: int = 4):
    return planner_scenarios.scenario(*pipelines, name="mixed", devices=devices, steps=STEPS, policies=("jigsaw",))


def lm(name: str = "qwen", **changes) -> dict:
    return planner_scenarios.lm_pipeline(**{"name": name, "length_bands": [1024, 2048], **changes})


def flow(name: str = "sd", **changes) -> dict:
    return planner_scenarios.flow_pipeline(**{"name": name, "trained_timesteps": 4, **changes})


def on_the_whole_pool(scenario, policy: str):
    """`policy` run with every pipeline on the whole pool, the multiplexing these tests are about (jigsaw's search
    gives the pipelines disjoint sub-pools where the simulator finds that faster): its cost-model shapes, the
    rollout memory from its memory model. (Prepared, Trace)."""
    cost = CostModel(scenario.cluster.device)
    devices = scenario.cluster.devices
    shapes = {spec.name: Jigsaw.shape(spec, devices, None, cost) for spec in scenario.pipelines}
    shapes = rollout_shares(scenario.pipelines, shapes, dict.fromkeys(shapes, cost), STEPS)
    prepared = prepare(scenario, policy, shapes=shapes)
    return prepared, run_prepared(scenario, prepared)


def check_every_step_committed(prepared, trace) -> None:
    """Every node ran within the executor's invariants and every pipeline committed every step, on-policy."""
    check_trace(prepared.graph, prepared.setup, trace)
    committed = {(record.pipeline, record.step) for record in trace.steps}
    assert committed == {(p, s) for p in prepared.graph.pipelines() for s in range(STEPS)}
    assert {record.step - record.rollout_version for record in trace.steps} == {0}


@pytest.mark.parametrize("policy", ["jigsaw", "jigsaw-greedy"])
def test_a_flow_pipeline_shares_the_pool_with_a_language_model_pipeline(policy):
    prepared, trace = on_the_whole_pool(scenario(lm(), flow()), policy)
    check_every_step_committed(prepared, trace)
    shape = prepared.setup.shapes["sd"]
    assert isinstance(shape, FlowShape) and shape.shared and not shape.recompute_logprob
    assert not any(node.exclusive for node in prepared.graph)
    overlapping = {
        (a.kind, b.kind)
        for a in trace.spans
        if a.pipeline == "qwen"
        for b in trace.spans
        if b.pipeline == "sd" and a.device == b.device and a.start < b.end and b.start < a.end
    }
    assert ("decode", "generate") in overlapping, "the flow pipeline generates beside the LM's decode"
    assert any(kind in {"train", "logprob"} for pair in overlapping for kind in pair), (
        "one pipeline's trainer work runs beside the other's"
    )


def test_a_flow_pipeline_alone_under_jigsaw_generates_one_fragment_per_device():
    prepared, trace = simulate(scenario(flow()), "jigsaw")
    check_every_step_committed(prepared, trace)
    assert prepared.setup.shapes["sd"].fragments == 4
    for step in range(STEPS):
        devices = {s.device for s in trace.spans if s.step == step and s.kind == Kind.GENERATE}
        assert devices == {0, 1, 2, 3}
    trainer = {s.device for s in trace.spans if s.kind == Kind.TRAIN}
    assert trainer == {0, 1, 2, 3}, "train nodes run on the whole pool"


def step_latency(trace, pipeline: str) -> float:
    records = [r for r in trace.steps if r.pipeline == pipeline]
    return sum(r.end - r.start for r in records) / len(records)


def test_a_higher_priority_pipeline_trains_first_under_jigsaw():
    """Two pipelines on the whole pool whose rollouts end together, so their trainer work competes for it: with equal
    priorities the look-ahead trains the shorter one ("b-quick": no log-prob passes) first, though the names
    would put the other first; weighting the longer one twice as much sends it first and lowers its mean step
    latency (4.00 s -> 3.73 s)."""
    uniform = {"lengths": {"kind": "empirical", "values": [500]}, "length_bands": []}
    quick = lm("b-quick", reference=False, recompute_logprob=False, **uniform)

    def latencies(priority: float) -> tuple[float, float]:
        _, trace = on_the_whole_pool(scenario(lm("a-long", priority=priority, **uniform), quick), "jigsaw")
        return step_latency(trace, "b-quick"), step_latency(trace, "a-long")

    (quick_equal, long_equal), (quick_after, long_first) = latencies(1.0), latencies(2.0)
    assert long_first < 0.97 * long_equal
    assert quick_after > quick_equal, "the other pipeline waits instead"


@pytest.mark.parametrize("pipeline", [lm(priority=0), flow(priority=-1.0)])
def test_a_priority_that_is_not_positive_is_a_one_line_error_naming_it(pipeline):
    with pytest.raises(ValueError) as error:
        scenario(pipeline)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("scenario: invalid scenario: pipelines.0.") and ".priority: " in message


def test_jigsaw_places_a_shape_of_every_kind_it_schedules_on_a_sub_pool_and_back():
    """Every kind jigsaw schedules has its shape's sliced class (`SLICED`), and placing a cut on a sub-pool keeps its
    fields, adds the place, and comes back the kind's own shape."""
    assert set(SLICED) == {KINDS[kind].load("shape") for kind in Jigsaw.pipeline_kinds}
    cost = CostModel("H100")
    for spec in scenario(lm(), flow()).pipelines:
        shape = Jigsaw.shape(spec, 2, None, cost)
        sliced = on_slice(shape, 2, turn=1)
        assert isinstance(sliced, type(shape)) and type(sliced) in UNSLICED
        assert (sub_pool(sliced), turn_of(sliced), sub_pool(shape), turn_of(shape)) == ((2, 3), 1, (0, 1), 0)
        assert base_shape(sliced) == shape and type(base_shape(sliced)) is type(shape)
        assert sliced.describe() == f"turn 1, devices 2-3: {shape.describe()}"
