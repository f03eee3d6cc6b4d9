"""The planner's multi-turn pipelines (`graph.lm._turns`, `graph.spec.TurnsSpec`): each turn a decode node, each
environment step between two turns a wait that holds no device (`Kind.ENV`), drawn from the seed by who waits; a
lone pipeline's engine idles through its waits by the closed-form amount, and jigsaw fills one pipeline's waits with
another's work. A run's own scenario (`LMTrainConfig.scenario`) holds its engines through the waits, as the Ray
runtime rolls trajectories out unless env.free_waits, and takes its turns from the task or the start-up profile; with
free waits its chains cover env.max_turns."""

import math
from pathlib import Path

import pytest
import yaml
from planner_scenarios import lm_pipeline, scenario
from test_multiturn import env_tree

from dovetail.config.load import ConfigError, load_config, parse_config
from dovetail.cost.model import CostModel
from dovetail.graph.latency import Latency
from dovetail.graph.lm import LMShape, build_lm, step_samples
from dovetail.graph.node import Kind
from dovetail.plan.prepare import simulate
from dovetail.plan.scenario import load_scenario
from dovetail.sched.policy import MAX_STALENESS, PolicyOptions

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TURNS = 3
STEPS = 2


def agentic(name: str = "a", latency: dict | None = None, turns: int = TURNS, hold: bool = False, **changes) -> dict:
    """A small Qwen3-0.6B multi-turn pipeline: 8 prompts of 4, `turns` turns each, 100 observation tokens a step."""
    return lm_pipeline(
        name=name,
        batch=8,
        group=4,
        length_bands=[],
        multi_turn=True,
        turns={
            "counts": [turns],
            "observation_tokens": 100,
            "latency": latency or {"kind": "constant", "seconds": 0.0},
            "waits_hold_device": hold,
        },
        **changes,
    )


def run(*pipelines: dict, policy: str = "verl-sync", devices: int = 4, **options):
    return simulate(
        scenario(*pipelines, devices=devices, steps=STEPS, policies=[policy]),
        policy,
        steps=STEPS,
        options=PolicyOptions(**options),
    )


def test_a_lone_pipeline_s_step_time_rises_by_its_waits_on_the_critical_path():
    """verl-sync, one pipeline: each step's rollout waits turns - 1 times on its environment, every shard alike
    under a constant latency, and nothing else runs meanwhile: the makespan rises by steps x (turns - 1) x latency,
    the devices' work is unchanged, and no device of a shard runs anything while that shard waits."""
    latency = 2.5
    _, without = run(agentic())
    prepared, trace = run(agentic(latency={"kind": "constant", "seconds": latency}))
    waits = [node for node in prepared.graph if node.kind == Kind.ENV]
    shards = prepared.setup.shapes["a"].rollout_engines
    assert len(waits) == STEPS * shards * (TURNS - 1) and {node.wait_s for node in waits} == {latency}
    assert trace.makespan - without.makespan == pytest.approx(STEPS * (TURNS - 1) * latency, abs=1e-9)
    work = sum((s.end - s.start) * s.share for s in trace.spans)
    assert work == pytest.approx(sum((s.end - s.start) * s.share for s in without.spans), rel=1e-12)
    assert len(trace.waits) == len(waits)
    for wait in trace.waits:
        shard = int(wait.node.split("/")[3])  # a/<step>/env/<shard>/<turn>; verl-sync: shard k on device k
        assert wait.end - wait.start == pytest.approx(latency)
        assert not [s for s in trace.spans if s.device == shard and s.start < wait.end and s.end > wait.start]


def test_a_wait_is_drawn_from_the_seed_by_who_waits_and_goes_on():
    """Each env node waits the longest of its trajectories' draws (`Latency.draw(seed, pipeline, sample, turn)`,
    as a run keys a step's wait), only those that take another turn: the same seed, the same waits."""
    latency = {"kind": "lognormal", "median_s": 1.0, "sigma": 0.8}
    spec = scenario(agentic(latency=latency, turns=TURNS)).pipelines[0]
    spec = spec.model_copy(update={"turns": spec.turns.model_copy(update={"counts": [1, 2, 3]})})
    shape, cost = LMShape(shards=2, trainer_devices=4), CostModel("H100")
    nodes = build_lm(spec, 1, shape, cost, seed=7)
    samples = {s.id: s for s in step_samples(spec, 0, 2, 7)}
    draw = Latency.model_validate(latency).draw
    waits = [node for node in nodes if node.kind == Kind.ENV]
    assert waits and all(not node.holds_device and node.cost_s == 0 for node in waits)
    for node in waits:
        shard, turn = (int(part) for part in node.id.split("/")[3:])
        going_on = [s for s in samples.values() if s.shard == shard and s.turns > turn + 1]
        assert set(node.samples) == {s.id for s in going_on}
        assert node.wait_s == max(draw(7, "a", *s.id, turn) for s in going_on)
    assert [n.wait_s for n in build_lm(spec, 1, shape, cost, seed=7) if n.kind == Kind.ENV] == [n.wait_s for n in waits]
    assert [n.wait_s for n in build_lm(spec, 1, shape, cost, seed=8) if n.kind == Kind.ENV] != [n.wait_s for n in waits]
    decodes = [n for n in nodes if n.kind == Kind.DECODE]
    assert sum(n.tokens for n in decodes) == sum(s.response_tokens for s in samples.values())  # turns share them


@pytest.mark.parametrize(
    "latency", [{"kind": "constant", "seconds": 1.0}, {"kind": "lognormal", "median_s": 1.0, "sigma": 0.5}]
)
def test_the_runtime_s_rollout_holds_its_engine_through_the_waits(latency):
    """waits_hold_device: one decode node per shard, the runtime's (its id), holding its device through its waits.
    Under a constant latency every trajectory of a shard waits alike and at once, so the held node waits exactly the
    free graph's waits of that shard, and alone on verl-sync (nothing could fill them) both take as long; under a
    lognormal one a trajectory answered first decodes its next turn during the others' waits, in rounds of its own
    (the closed form below), so the held node's span differs from the free chain's either way: a wait overlapped, a
    batch split into rounds that each pay a memory-bound decode."""
    free, free_trace = run(agentic(latency=latency))
    held, held_trace = run(agentic(latency=latency, hold=True))
    assert not [n for n in held.graph if not n.holds_device]
    decodes = {n.id: n for n in held.graph if n.kind == Kind.DECODE}
    assert sorted(decodes) == sorted(f"a/{step}/decode/{shard}/0" for step in range(STEPS) for shard in range(4))
    constant = latency["kind"] == "constant"
    for node in decodes.values():
        chain = [n for n in free.graph if n.step == node.step and n.shard == node.shard and n.kind != Kind.PREFILL]
        waits = sum(n.wait_s for n in chain if n.kind == Kind.ENV)
        busy = sum(n.cost_s for n in chain if n.kind == Kind.DECODE)
        assert node.fixed_s == 0 and node.tokens == sum(n.tokens for n in chain)
        if constant:
            assert node.wait_s == pytest.approx(waits) and node.cost_s == pytest.approx(busy)
    if constant:
        assert held_trace.makespan == pytest.approx(free_trace.makespan, rel=1e-9)


def test_a_held_rollout_decodes_a_returned_trajectory_during_another_s_wait():
    """The closed form of the runtime's held rollout on two trajectories of two turns each (one prompt of 2, one
    shard): both decode their first turn as one batch (d0); the one whose wait ends first (w_first) decodes its second
    turn alone (d_first) while the other still waits, and the engine sleeps until the other's wait ends (w_last),
    then decodes its second turn alone (d_last). Busy d0 + d_first + d_last; slept w_first + (w_last - w_first -
    d_first); span d0 + w_last + d_last. Pricing each turn as its decode plus its longest wait (both second turns as
    one batch after w_last) overprices it by the batch's time."""
    observation = 100
    spec = scenario(
        agentic(latency={"kind": "lognormal", "median_s": 1.0, "sigma": 1.0}, turns=2, hold=True)
        | {"batch": 1, "group": 2, "micro_batches": 1}
    ).pipelines[0]
    shape, cost = LMShape(shards=1, trainer_devices=1), CostModel("H100")
    model = spec.catalogue_model()
    draw = Latency.model_validate(spec.turns.latency.model_dump()).draw

    def case(seed: int):
        samples = step_samples(spec, 0, 1, seed)
        assert [s.turns for s in samples] == [2, 2]
        first_turn = [(s.response_tokens + 1) // 2 for s in samples]  # turn_tokens: the length shared out evenly
        waits = [draw(seed, "a", *s.id, 0) for s in samples]
        held = [s.prompt_tokens + t + observation for s, t in zip(samples, first_turn)]

        def second(i: int) -> float:  # trajectory i's second turn, decoded alone
            return cost.decode(model, [held[i]], [samples[i].response_tokens - first_turn[i]]) + cost.reprefill(
                model, [held[i]]
            )

        early, late = sorted(range(2), key=lambda i: waits[i])
        d0 = cost.decode(model, [s.prompt_tokens for s in samples], first_turn)
        return samples, waits, d0, early, late, second

    seed = next(s for s in range(100) if (c := case(s))[1][c[4]] - c[1][c[3]] > c[5](c[3]))
    samples, waits, d0, early, late, second = case(seed)
    (node,) = [n for n in build_lm(spec, 1, shape, cost, seed=seed) if n.kind == Kind.DECODE]
    assert node.samples == tuple(s.id for s in samples)
    assert node.cost_s == pytest.approx(d0 + second(early) + second(late), rel=1e-12)
    assert node.wait_s == pytest.approx(waits[late] - second(early), rel=1e-12)
    assert node.cost_s + node.wait_s == pytest.approx(d0 + waits[late] + second(late), rel=1e-12)


def test_jigsaw_fills_one_pipeline_s_waits_with_the_other_s_work():
    """Two agentic pipelines sharing the whole pool under jigsaw: while one's trajectories wait on their environment,
    the other's nodes run on the engines they left, and both end sooner than jigsaw's own back to back."""
    a = agentic("a", {"kind": "constant", "seconds": 3.0}, turns=4)
    b = agentic(
        "b", {"kind": "constant", "seconds": 3.0}, turns=2, lengths={"kind": "lognormal", "median": 1200, "sigma": 0.5}
    )
    _, shared = run(a, b, policy="jigsaw", arrangement="shared")
    _, in_turn = run(a, b, policy="jigsaw", arrangement="back_to_back")
    assert shared.makespan < in_turn.makespan
    filled = 0.0
    for wait in (w for w in shared.waits if w.pipeline == "a"):
        shard = int(wait.node.split("/")[3])  # the whole pool shared: a's shard k on device k
        filled += sum(
            min(s.end, wait.end) - max(s.start, wait.start)
            for s in shared.spans
            if s.pipeline == "b" and s.device == shard and s.start < wait.end and s.end > wait.start
        )
    assert filled > 0


def test_jigsaw_with_staleness_one_rolls_a_step_out_while_the_one_before_trains():
    """`staleness: 1`: once a step's rollout has begun (its prefills placed), its pipeline's next step opens on the
    weights published then, one version behind; so the next step's rollouts run while the step trains, every step
    stays within one version, and the run ends sooner than on-policy jigsaw's on the same pipelines; with
    `staleness: 2` a third step may roll out meanwhile (the shipped agentic multiplex here), within two versions."""
    a = agentic("a", {"kind": "constant", "seconds": 3.0}, turns=4)
    b = agentic("b", {"kind": "constant", "seconds": 3.0}, turns=2)
    _, on_policy = run(a, b, policy="jigsaw", arrangement="shared")
    _, stale = run(a, b, policy="jigsaw", arrangement="shared", staleness=1)
    assert {r.step - r.rollout_version for r in on_policy.steps} == {0}
    assert {r.step - r.rollout_version for r in stale.steps} == {0, 1}  # the first step has no earlier weights
    assert stale.makespan < on_policy.makespan
    shipped = load_config(CONFIGS / "multiplex-agentic.yaml")
    options = PolicyOptions(arrangement="shared", staleness=2)
    _, staler = simulate(shipped.scenario(4), "jigsaw", steps=4, options=options)
    assert {r.step - r.rollout_version for r in staler.steps} == {0, 1, 2}
    for record in (r for r in stale.steps if r.step > r.rollout_version):
        spans = [s for s in stale.spans if s.pipeline == record.pipeline]
        last_train = max(s.end for s in spans if s.step == record.step - 1 and s.kind == "train")
        first_prefill = min(s.start for s in spans if s.step == record.step and s.kind == "prefill")
        assert first_prefill < last_train  # its rollout began before the step before finished training


def test_staleness_is_jigsaw_s_and_bounded():
    with pytest.raises(ValueError, match=f"staleness {MAX_STALENESS + 1}: use 0"):
        PolicyOptions.of({"staleness": MAX_STALENESS + 1})
    tree = yaml.safe_load((CONFIGS / "multiplex-agentic.yaml").read_text())
    with pytest.raises(ConfigError, match="staleness=1: only policy jigsaw takes it"):
        parse_config(tree | {"policy": "jigsaw-greedy", "staleness": 1})
    assert parse_config(tree | {"staleness": 1}).policy_options().staleness == 1


def test_a_run_s_scenario_takes_its_turns_from_the_task_then_from_its_profile(tmp_path):
    """calc: a problem whose ideal completion calls the calculator takes two turns and one observation (its result),
    the others one; the run's engines hold their device through env.latency's waits. A user's environment: env.max_turns
    until the start-up profile's episodes say how many turns they took and how many tokens their observations had."""
    calc = parse_config(
        {"kind": "lm", "task": "calc", "env": {"name": "arithmetic", "parser": "plain", "latency": {"seconds": 0.2}}}
    )
    (spec,) = calc.scenario(1).pipelines
    assert spec.turns is not None and spec.turns.waits_hold_device and spec.turns.latency.seconds == 0.2
    tags = len("<result></result>")  # a product of two 3- to 6-digit numbers has 5 to 12 digits
    assert set(spec.turns.counts) == {1, 2} and tags + 5 <= spec.turns.observation_tokens <= tags + 12
    user = parse_config(env_tree(tmp_path) | {"env": env_tree(tmp_path)["env"] | {"max_turns": 5}})
    assert user.scenario(1).pipelines[0].turns.counts == [5]
    profiled = user.profiled({"turns": [1, 3, 3, 1], "observation_tokens": [0, 12, 20, 0]})
    turns = profiled.scenario(1).pipelines[0].turns
    assert turns.counts == [1, 3, 3, 1] and turns.observation_tokens == math.floor(32 / 4 + 0.5)


def test_a_run_with_free_waits_covers_its_max_turns_and_prices_only_its_forecast_turns():
    """env.free_waits: a run learns its trajectories' turns by decoding, so each shard's chain covers env.max_turns
    turns, an env node between every two (the runtime's nodes); the turns past the forecast ones decode nothing and
    wait none, so the forecast prices the task's turns alone: the same step as the graph cut at them, but for the
    fixed costs of the empty nodes."""
    tree = {"kind": "lm", "task": "calc", "env": {"name": "arithmetic", "parser": "plain", "latency": {"seconds": 0.2}}}
    held = parse_config(tree)
    free = parse_config(tree | {"env": tree["env"] | {"free_waits": True, "max_turns": 5}})
    (spec,) = free.scenario(1).pipelines
    assert spec.turns is not None and not spec.turns.waits_hold_device and spec.turns.max_turns == 5
    assert held.scenario(1).pipelines[0].turns.max_turns is None
    cost = CostModel(free.cluster.device)
    nodes = build_lm(spec, 1, LMShape(2, 2), cost)
    for shard in (0, 1):
        chain = [n for n in nodes if n.shard == shard and n.kind in (Kind.DECODE, Kind.ENV)]
        assert [n.kind for n in chain] == [Kind.DECODE, *[Kind.ENV, Kind.DECODE] * 4]
        assert all(a.id in b.deps for a, b in zip(chain, chain[1:]))  # one chain: turn, its wait, the next turn
        past = [n for n in chain if n.kind == Kind.DECODE][max(spec.turns.counts) :]
        assert past and all(n.samples == () and n.cost_s == n.fixed_s == n.tokens == 0 for n in past)
        assert all(n.wait_s == 0 for n in chain[2 * max(spec.turns.counts) - 1 :] if n.kind == Kind.ENV)
    cut = build_lm(
        spec.model_copy(update={"turns": spec.turns.model_copy(update={"max_turns": None})}), 1, LMShape(2, 2), cost
    )
    priced = {n.id: n.cost_s for n in cut}
    assert all(n.cost_s == priced[n.id] for n in nodes if n.id in priced)  # the forecast turns cost what they did


def test_the_shipped_agentic_scenario_prices_waits_that_hold_no_device():
    shipped = load_scenario("agentic-search-qwen2.5-7b-8xh100")
    assert all(p.turns is not None and not p.turns.waits_hold_device for p in shipped.pipelines)
    prepared, trace = simulate(shipped, "verl-sync", steps=1)
    assert trace.waits and all(w.end > w.start for w in trace.waits)


@pytest.mark.parametrize("name", ["multiplex-agentic.yaml", "multiplex-agentic-flow.yaml"])
def test_the_shipped_agentic_multiplex_configs_load_and_their_policy_plans_every_pipeline_s_steps(name):
    """Two agentic pipelines, or one beside a flow pipeline: each agentic pipeline's scenario has turns whose waits
    are its env.latency, held by its engines as the runtime holds them, and the config's policy (jigsaw) plans every
    pipeline's steps on the shared pool (the flow pipeline's as configs/multiplex.yaml's)."""
    config = load_config(CONFIGS / name)
    scenario = config.scenario(STEPS)
    entries = {entry.name: entry for entry in config.pipelines}
    assert {spec.name for spec in scenario.pipelines} == set(entries)
    agentic = [spec for spec in scenario.pipelines if getattr(spec, "turns", None) is not None]
    assert agentic and all(spec.turns.waits_hold_device for spec in agentic)
    assert all(spec.turns.latency == entries[spec.name].env.latency for spec in agentic)
    if name == "multiplex-agentic-flow.yaml":
        assert sorted(entry.kind for entry in entries.values()) == ["flow", "lm"]
    _, trace = simulate(
        scenario, config.policy, steps=STEPS, options=config.policy_options(), **config.shape_overrides()
    )
    assert sorted((r.pipeline, r.step) for r in trace.steps) == sorted((p, s) for p in entries for s in range(STEPS))


LONG_RUN_STEPS = 6
"""Steps each policy's chosen shape is simulated over to read its steady step independently of `plan`'s figures:
the first three warm up (a one-step-off policy's pipeline fills by its third commit), the last three are steady."""


def test_plan_names_the_policy_that_steps_fastest_once_warm_on_the_agentic_scenario():
    """Search-R1's agentic scenario simulates two steps, over which jigsaw makes the most samples/s: streamrl's first
    step rolls out on half the pool, then trains, nothing overlapped yet. Once warm, streamrl rolls a step out beside
    the previous step's training. Each policy's chosen shape simulated over `LONG_RUN_STEPS` steps, its steady step
    the mean of its last commit-to-commit intervals, says which policy steps fastest once warm; `plan` names it (up
    to a tie of 1 %: streamrl and areal cut the same shape) and its best line gives that throughput first, the most
    of every row's, with the warm-up's figure beside it."""
    from dovetail.plan.prepare import prepare, run_prepared
    from dovetail.plan.report import allowed_policies, plan

    shipped = load_scenario("agentic-search-qwen2.5-7b-8xh100")
    devices = shipped.cluster.devices
    steady: dict[str, float] = {}
    samples: dict[str, int] = {}
    for policy in allowed_policies(shipped):
        chosen = prepare(shipped, policy, devices=devices).setup.shapes
        trace = run_prepared(shipped, prepare(shipped, policy, devices=devices, steps=LONG_RUN_STEPS, shapes=chosen))
        ends = [record.end for record in trace.steps]
        steady[policy] = (ends[-1] - ends[2]) / (len(ends) - 3)
        samples[policy] = trace.steps[-1].samples
    fastest = min(steady.values())
    text = plan(shipped, devices)
    (best,) = [line for line in text.splitlines() if line.startswith("best: ")]
    named = best.split(" under ")[1].split(" -> ")[0]
    assert steady[named] <= fastest * 1.01, (named, steady)
    assert [p for p in steady if steady[p] > fastest * 1.01], steady  # some policy is slower: the choice matters
    once_warm = float(best.split(" -> ")[1].split(" samples/s once warm")[0])
    rows = [line for line in text.splitlines() if line.startswith(("  *", "   "))]
    assert once_warm == max(float(row.split("(")[1].split(" once warm")[0]) for row in rows)
    assert once_warm == pytest.approx(samples[named] / steady[named], rel=0.05)
