"""`jigsaw` never loses to an arrangement it could have chosen: its search also simulates the split pool (each pipeline
its own even slice, as verl-sync's `splits_pool`) and back to back (the pipelines take the whole pool in turns, each
under its kind's best single-pipeline policy: verl-sync for a language-model pipeline, digen for a flow one), keeps
the fastest, and its policy carries the chosen arrangement out. Checked on the shipped multiplex scenarios and on
configs/multiplex.yaml's, against those arrangements simulated on their own."""

from pathlib import Path

import planner_scenarios
import pytest

from dovetail.config.load import load_config
from dovetail.exec.plan import Searched, prepare, run_prepared, simulate
from dovetail.report import plan
from dovetail.scenario import Scenario, list_scenarios, load_scenario
from dovetail.sched.arrangement import SPLIT, TURNS, mode_of
from dovetail.sched.policy import search_horizon

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(name for name in list_scenarios() if name.startswith("jigsaw-"))
CONFIG_STEPS = 3


def rate(trace) -> float:
    return sum(r.samples for r in trace.steps) / trace.makespan


def at_least(mine: float, other: float) -> bool:
    return mine >= other * (1 - 1e-9)


def multiplex_config() -> Scenario:
    return load_config(ROOT / "configs" / "multiplex.yaml").scenario(CONFIG_STEPS)


def scenarios() -> list[tuple[str, Scenario]]:
    return [(name, load_scenario(name)) for name in SHIPPED] + [("configs/multiplex.yaml", multiplex_config())]


def back_to_back(scenario: Scenario, steps: int) -> float:
    """Samples/s of the pipelines run one after another on the whole pool, each alone under its own best policy."""
    samples = makespan = 0.0
    for spec in scenario.pipelines:
        alone = scenario.model_copy(update={"pipelines": [spec]})
        trace = simulate(alone, "verl-sync" if spec.kind == "lm" else "digen", steps=steps)[1]
        samples += sum(r.samples for r in trace.steps)
        makespan += trace.makespan
    return samples / makespan


def test_the_shipped_multiplex_scenarios_are_checked():
    assert len(SHIPPED) >= 3


@pytest.mark.parametrize("name", [*SHIPPED, "configs/multiplex.yaml"])
def test_jigsaw_is_predicted_no_slower_than_the_split_pool_or_back_to_back(name):
    scenario = dict(scenarios())[name]
    steps = search_horizon(scenario.schedule.steps)
    searched: list[Searched] = []
    prepared = prepare(scenario, "jigsaw", steps=steps, searched=searched)
    mine = rate(run_prepared(scenario, prepared))
    considered = {mode_of(s.shapes) for s in searched if s.horizon == steps}
    assert {SPLIT, TURNS} <= considered
    assert all(at_least(mine, s.samples_per_s) for s in searched if s.horizon == steps)
    # ... and no slower than the arrangements simulated on their own, by the policies that define them.
    assert at_least(mine, back_to_back(scenario, steps) * (1 - 1e-3))
    if all(spec.kind == "lm" for spec in scenario.pipelines):
        assert at_least(mine, rate(simulate(scenario, "verl-sync", steps=steps)[1]))


def three_pipelines(devices: int = 4) -> Scenario:
    lm = [planner_scenarios.lm_pipeline(name=f"lm{i}", length_bands=[1024, 2048]) for i in range(3)]
    return planner_scenarios.scenario(*lm, name="three", devices=devices, steps=3, policies=("verl-sync", "jigsaw"))


def test_with_three_pipelines_jigsaw_is_no_slower_than_verl_sync_s_split_pool():
    scenario = three_pipelines()
    assert at_least(rate(simulate(scenario, "jigsaw")[1]), rate(simulate(scenario, "verl-sync")[1]))


@pytest.mark.parametrize("mode", [SPLIT, TURNS])
def test_the_chosen_arrangement_is_carried_out(mode):
    """Forced onto an arrangement, jigsaw runs it: every step of every pipeline commits on-policy, on its slice
    (split pool) or one pipeline after another (back to back)."""
    scenario = multiplex_config()
    searched: list[Searched] = []
    prepare(scenario, "jigsaw", steps=CONFIG_STEPS, searched=searched)
    shapes = next(s.shapes for s in searched if mode_of(s.shapes) == mode)
    prepared = prepare(scenario, "jigsaw", steps=CONFIG_STEPS, shapes=shapes)
    trace = run_prepared(scenario, prepared)
    committed = {(r.pipeline, r.step) for r in trace.steps}
    assert committed == {(p, s) for p in prepared.graph.pipelines() for s in range(CONFIG_STEPS)}
    assert {r.step - r.rollout_version for r in trace.steps} == {0}
    spans = {p: [span for span in trace.spans if span.pipeline == p] for p in prepared.graph.pipelines()}
    devices = {p: {span.device for span in spans[p]} for p in spans}
    if mode == SPLIT:
        first, second = devices.values()
        assert first.isdisjoint(second)
    else:
        first, second = prepared.policy.delegates.pipelines  # in turns, the scenario's order
        assert max(s.end for s in spans[first]) <= min(s.start for s in spans[second])


def test_dovetail_plan_lists_the_split_pool_and_back_to_back():
    text = plan(load_scenario("jigsaw-qwen3-4b-8xh100"), 8, ["jigsaw"])
    assert "split pool: " in text and "back to back: " in text
