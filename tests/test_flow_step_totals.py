"""`graph.flow.step_totals` (what digen's search ranks its cuts by, without building them) equals what the built step
says, exactly: per node kind the sum of the built nodes' seconds in their order, and the largest generate and train
working memory, over every shipped flow pipeline and cuts of every kind (GAP fragments of uneven size, staged
mini-batches, TSP chunks, recompute, trainer groups; LoRA, CFG, a reference model and a sampling trainer where
the scenarios have them)."""

import pytest

from dovetail.cost.model import CostModel
from dovetail.graph.flow import FlowShape, build_flow, step_totals
from dovetail.graph.node import Kind
from dovetail.graph.spec import FlowSpec
from dovetail.plan.scenario import list_scenarios, load_scenario

FLOW_SCENARIOS = sorted(
    {name for name in list_scenarios() if any(isinstance(spec, FlowSpec) for spec in load_scenario(name).pipelines)}
)


def cuts(spec: FlowSpec, devices: int) -> list[FlowShape]:
    chunks = sorted({1, min(3, spec.trained_timesteps), spec.trained_timesteps})
    fragments = sorted({spec.mini_batches, spec.mini_batches * max(1, min(3, spec.prompts // spec.mini_batches))})
    shapes = [
        FlowShape(f, chunk, recompute, trainers, trainer_group=group)
        for f in fragments
        for chunk in chunks
        for recompute in (False, True)
        for trainers, group in ((devices, None), (devices, devices // 2), (devices // 2, None))
        if group is None or trainers % group == 0
    ]
    staged = FlowShape(min(spec.samples, 3 * spec.mini_batches), 1, True, devices, staged=True)
    return [*shapes, staged]


@pytest.mark.parametrize("name", FLOW_SCENARIOS)
def test_step_totals_equal_the_built_step(name: str) -> None:
    scenario = load_scenario(name)
    spec = scenario.pipelines[0]
    assert isinstance(spec, FlowSpec)
    cost = CostModel(scenario.cluster.catalogue_device())
    for shape in cuts(spec, scenario.cluster.devices):
        nodes = build_flow(spec, 1, shape, cost)
        totals = step_totals(spec, shape, cost)
        assert totals.seconds == {kind: sum(n.cost_s for n in nodes if n.kind == kind) for kind in Kind}, shape
        assert totals.generate_gb == max(n.memory_gb for n in nodes if n.kind == Kind.GENERATE)
        assert totals.train_gb == max(n.memory_gb for n in nodes if n.kind == Kind.TRAIN)
