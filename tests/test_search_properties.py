"""Searches never lose to a shape they could have chosen, on random small scenarios (hypothesis).

Every figure is an independent simulation: the candidate's shapes fixed (`prepare(shapes=...)`), run by the
simulator, against the policy's own run with the shapes its search chose."""

import json
from dataclasses import asdict, replace

import planner_scenarios
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dovetail.cost.catalog import DEVICES, dominates
from dovetail.cost.catalog import device as lookup_device
from dovetail.cost.model import CostModel
from dovetail.plan.prepare import Searched, prepare, run_prepared, simulate
from dovetail.plan.report import plan
from dovetail.plan.scenario import Scenario, load_scenario
from dovetail.sched import digen_search, shape_from_fields
from dovetail.sched.digen_search import trainer_layout
from dovetail.sched.jigsaw import base_shape, on_slice, sub_pool, turn_of
from dovetail.sched.policy import search_horizon

pytestmark = pytest.mark.slow

SEARCH = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rate(trace) -> float:
    return sum(r.samples for r in trace.steps) / trace.makespan


def at_least(mine: float, other: float) -> bool:
    """`mine` >= `other` up to float rounding (the same simulation gives the same bits)."""
    return mine >= other * (1 - 1e-9)


flow_cases = st.fixed_dictionaries(
    {
        "devices": st.integers(2, 8),
        "prompts": st.sampled_from([4, 6, 8]),
        "group": st.integers(2, 4),
        "trained": st.integers(1, 4),
        "model": st.sampled_from(["SD3.5-M", "FLUX.1-12B", "Wan2.1-14B"]),
        "device": st.sampled_from(["H100", "A100-80G"]),
        "steps": st.integers(2, 3),
    }
)


def flow_scenario(case, devices: int | None = None) -> Scenario:
    video = case["model"] == "Wan2.1-14B"
    pipeline = planner_scenarios.flow_pipeline(
        model=case["model"],
        prompts=case["prompts"],
        group=case["group"],
        denoising_steps=8,
        trained_timesteps=case["trained"],
        frames=17 if video else 1,
        offload=case["model"] != "SD3.5-M",
    )
    return planner_scenarios.scenario(
        pipeline,
        name="random-flow",
        device=case["device"],
        devices=devices or case["devices"],
        steps=case["steps"],
        policies=("colocated", "digen", "digen+tcss"),
    )


lm_cases = st.fixed_dictionaries(
    {
        "devices": st.integers(1, 8),
        "pipelines": st.integers(1, 2),
        "batch": st.sampled_from([8, 16]),
        "model": st.sampled_from(["Qwen3-0.6B", "Qwen3-4B"]),
        "median": st.sampled_from([150, 400]),
        "steps": st.integers(1, 3),
    }
)


def lm_scenario(case) -> Scenario:
    pipelines = [
        planner_scenarios.lm_pipeline(
            name=f"lm{i}",
            model=case["model"],
            batch=case["batch"],
            prompt_length=128,
            lengths={"kind": "lognormal", "median": case["median"], "sigma": 0.9},
            length_bands=[512, 1024, 2048],
        )
        for i in range(case["pipelines"])
    ]
    return planner_scenarios.scenario(
        *pipelines,
        name="random-lm",
        devices=max(case["devices"], case["pipelines"]),
        steps=case["steps"],
        policies=("verl-sync", "jigsaw"),
    )


def check_never_loses_to_a_candidate(scenario: Scenario, policy: str) -> None:
    searched: list[Searched] = []
    prepared = prepare(scenario, policy, searched=searched)
    chosen = rate(run_prepared(scenario, prepared))
    final = [s for s in searched if s.horizon == search_horizon(scenario.schedule.steps)]
    assert final, "the search simulated its candidates over the run's steps"
    assert any(s.shapes == prepared.setup.shapes for s in final)
    for candidate in final:
        alone = rate(simulate(scenario, policy, shapes=candidate.shapes)[1])
        assert alone == candidate.samples_per_s, "the search saw what the simulator gives"
        assert at_least(chosen, alone), (policy, candidate.shapes, alone, chosen)


@SEARCH
@given(flow_cases, st.sampled_from(["digen", "digen+tcss"]))
def test_digen_never_loses_to_a_shape_it_simulated(case, policy):
    check_never_loses_to_a_candidate(flow_scenario(case), policy)


@SEARCH
@given(lm_cases)
def test_jigsaw_never_loses_to_a_shape_it_simulated(case):
    scenario = lm_scenario(case)
    try:
        check_never_loses_to_a_candidate(scenario, "jigsaw")
    except ValueError as error:  # a model that does not fit beside its resident trainers is refused, by name
        assert "jigsaw" in str(error) and "\n" not in str(error)


@SEARCH
@given(flow_cases)
def test_digen_never_below_its_colocated_like_shape_nor_the_staged_baselines_and_tcss_never_below_digen(case):
    scenario = flow_scenario(case)
    spec, devices = scenario.pipelines[0], scenario.cluster.devices
    digen = rate(simulate(scenario, "digen")[1])
    candidates = digen_search.candidates(spec, devices, None, CostModel(case["device"]))
    shared = next(shape for _, shape in candidates if shape.trainer_devices == devices)
    assert at_least(digen, rate(simulate(scenario, "digen", shapes={"p": shared})[1]))
    for baseline in ("colocated", "colocated-hsdp", "disaggregated"):
        assert at_least(digen, rate(simulate(scenario, baseline)[1])), baseline
    assert at_least(rate(simulate(scenario, "digen+tcss")[1]), digen)


@settings(SEARCH, max_examples=6)  # four searches per example
@given(flow_cases, st.sampled_from(["digen", "digen+tcss"]))
def test_doubling_the_devices_never_slows_digen(case, policy):
    """Inside a node and onto a second one: digen's search may keep the smaller run's cut per node (HSDP groups of a
    node, the staged baselines among its candidates), so twice the devices never predict less throughput."""
    rates = [rate(simulate(flow_scenario(case, devices), policy)[1]) for devices in (2, 4, 8, 16)]
    assert all(at_least(more, fewer) for fewer, more in zip(rates, rates[1:])), rates


def faster(name: str, factor: float):
    """The device with every rate `factor` times higher and every latency `factor` times lower (same memory)."""
    d = lookup_device(name)
    return replace(
        d,
        peak_flops=d.peak_flops * factor,
        memory_bandwidth=d.memory_bandwidth * factor,
        interconnect_bandwidth=d.interconnect_bandwidth * factor,
        network_bandwidth=d.network_bandwidth * factor,
        host_bandwidth=d.host_bandwidth * factor,
        interconnect_latency_s=d.interconnect_latency_s / factor,
        network_latency_s=d.network_latency_s / factor,
    )


@SEARCH
@given(
    flow_cases,
    st.sampled_from(["colocated", "colocated-hsdp", "disaggregated", "digen", "digen+tcss"]),
    st.sampled_from([1.5, 3]),
)
def test_a_strictly_faster_device_is_never_slower_for_flow_policies(case, policy, factor):
    scenario = flow_scenario(case)
    base = rate(simulate(scenario, policy)[1])
    quicker = rate(simulate(scenario, policy, cost=CostModel(faster(case["device"], factor)))[1])
    assert at_least(quicker, base), (policy, base, quicker)


@SEARCH
@given(lm_cases, st.sampled_from(["verl-sync", "jigsaw"]), st.sampled_from([1.5, 3]))
def test_a_strictly_faster_device_is_never_slower_for_lm_policies(case, policy, factor):
    scenario = lm_scenario(case)
    try:
        base = rate(simulate(scenario, policy)[1])
    except ValueError:
        return  # refused on this pool (tested in test_simulate_errors); nothing to compare
    quicker = rate(simulate(scenario, policy, cost=CostModel(faster("H100", factor)))[1])
    assert at_least(quicker, base), (policy, base, quicker)


def test_jigsaw_keeps_the_tail_engine_inside_a_node_on_the_64_gpu_scenario():
    """A tail engine wider than a node pays its tensor-parallel all-reduces over the network every token: the search
    simulates the wide engines and lets them lose (it once picked 32 wide, costed as if free)."""
    scenario = load_scenario("jigsaw-64xa100")
    searched: list[Searched] = []
    prepared = prepare(scenario, "jigsaw", searched=searched)
    node = lookup_device(scenario.cluster.device).node_size
    assert all(shape.tail_parallel <= node for shape in prepared.setup.shapes.values())
    wide = [s for s in searched if all(shape.tail_parallel > node for shape in s.shapes.values())]
    assert wide, "the search considered engines wider than a node"


def test_trainer_groups_no_larger_than_a_node_each_lie_inside_one():
    """The cost model prices a group that fits in a node on the intra-node links, so the pool places it inside one."""
    assert trainer_layout(16, 12, 6, 8) == (*range(2, 8), *range(10, 16))
    assert trainer_layout(16, 12, 4, 8) == tuple(range(4, 16))  # the last 12 devices already tile inside nodes
    assert trainer_layout(16, 12, 12, 8) == tuple(range(4, 16))  # one group past a node: the NIC is priced
    assert trainer_layout(12, 8, 8, 8) == tuple(range(8))  # the 4-device machine holds no group of 8
    assert trainer_layout(16, 14, 7, 8) == (*range(1, 8), *range(9, 16))
    assert trainer_layout(16, 12, 5, 8) is None  # 5 does not divide 12
    assert trainer_layout(16, 15, 5, 8) is None  # one group of 5 per node: 10 of the 15
    for devices, trainers, group in ((16, 12, 6), (24, 18, 6), (32, 21, 7), (16, 6, 3)):
        pool = trainer_layout(devices, trainers, group, 8)
        groups = [pool[i : i + group] for i in range(0, trainers, group)]
        assert len(set(pool)) == trainers and all(g[0] // 8 == g[-1] // 8 for g in groups), (devices, trainers, group)


def test_digen_with_a_fixed_trainer_pool_never_loses_to_a_group_size_plan_could_show():
    """digen-flux-16 with 12 trainers: two groups of 6 (one per node, 179 s a step) beat groups of 4 (209 s), which
    the search picked while it only tried groups tiling the last 12 devices (a group of 6 there straddles nodes)."""
    scenario = load_scenario("digen-flux-16")
    chosen = rate(simulate(scenario, "digen", trainer_devices=12, steps=3)[1])
    for group in (4, 6, 12):
        fixed = rate(simulate(scenario, "digen", trainer_devices=12, trainer_group=group, steps=3)[1])
        assert at_least(chosen, fixed), (group, chosen, fixed)


def test_digen_forced_to_lend_keeps_gap_and_otherwise_may_run_its_shape_stage_synchronously():
    """On digen-flux-16 the stage-synchronous trainer on digen's shared shape is the fastest candidate; a run that
    forces TAG gets a GAP shape (only GAP's schedule lends trainer devices)."""
    scenario = load_scenario("digen-flux-16")
    assert all(shape.staged for shape in prepare(scenario, "digen", steps=3).setup.shapes.values())
    forced = prepare(scenario, "digen", steps=3, options={"tag": "force"}).setup.shapes
    assert not any(shape.staged for shape in forced.values())


def test_plan_shows_each_policy_s_candidates_and_the_figure_simulate_gives_for_its_choice():
    scenario = load_scenario("calib-qwenimage-4xh200")
    text = plan(scenario, 4, ["digen", "digen+tcss"])
    for policy in ("digen", "digen+tcss"):
        after = text.split(f"\n{policy}: ")[1].splitlines()[1:]
        block = after[: next(i for i, line in enumerate(after) if not line.startswith("  "))]
        starred = [line for line in block if line.startswith("  *")]
        assert len(starred) == 1 and len(block) > 1
        shown = shown_rate(starred[0])
        steps = search_horizon(scenario.schedule.steps)
        assert shown == round(rate(simulate(scenario, policy, steps=steps)[1]), 3)
        assert all(shown_rate(line) <= shown for line in block)


def shown_rate(line: str) -> float:
    """The samples/s of one of plan's candidate rows."""
    return float(line.split("samples/s")[0].split()[-1])


def test_every_policy_s_chosen_shape_survives_a_run_profile_round_trip():
    """A run profile stores `asdict` of each pipeline's shape; `simulate --from-run` rebuilds it with the search's
    choices (digen's TAG and TCSS, jigsaw's sub-pools) intact."""
    for name, policy in (("calib-qwenimage-4xh200", "digen+tcss"), ("calib-qwenimage-4xh200", "colocated")):
        scenario = load_scenario(name)
        for shape in prepare(scenario, policy, steps=1).setup.shapes.values():
            rebuilt = shape_from_fields("flow", json.loads(json.dumps(asdict(shape))))
            assert rebuilt == shape and type(rebuilt) is type(shape)
    shapes = prepare(load_scenario("jigsaw-qwen3-4b-8xh100"), "jigsaw-greedy", steps=1).setup.shapes
    assert all(shape_from_fields("lm", asdict(shape)) == shape for shape in shapes.values())
    sliced = on_slice(next(iter(shapes.values())), 4, turn=1)
    rebuilt = shape_from_fields("lm", json.loads(json.dumps(asdict(sliced))))
    assert rebuilt == sliced and type(rebuilt) is type(sliced) and sub_pool(rebuilt) == tuple(range(4, 12))
    assert turn_of(rebuilt) == 1


def short_and_long_searched() -> tuple[list[dict], Scenario, list[Searched]]:
    """Two LM pipelines on 8 devices, one with short responses and one with long ones, and every candidate jigsaw
    simulated for them."""
    specs = [
        planner_scenarios.lm_pipeline(
            name=name,
            batch=16,
            prompt_length=128,
            lengths={"kind": "lognormal", "median": median, "sigma": 0.9},
            length_bands=[512, 1024],
        )
        for name, median in (("short", 150), ("long", 500))
    ]
    both = planner_scenarios.scenario(*specs, devices=8, steps=2, policies=("jigsaw",))
    searched: list[Searched] = []
    prepare(both, "jigsaw", searched=searched)
    return specs, both, searched


def test_back_to_back_runs_each_pipeline_alone_on_the_whole_pool_after_the_one_before():
    """The arrangement jigsaw weighs against multiplexing (`sched.jigsaw.back_to_back`, one pipeline per turn): the
    second pipeline's first node starts once the first's last node ended, each uses the whole pool, and the run
    takes what the two take alone on the pool, one after the other."""
    specs, both, searched = short_and_long_searched()
    in_turn = {
        tuple(sorted(s.shapes.items())): s.shapes
        for s in searched
        if sorted(turn_of(shape) for shape in s.shapes.values()) == [0, 1]
    }
    assert {turns["short"].migrate_at is None for turns in in_turn.values()} == {True, False}  # tails home or not
    for turns in in_turn.values():
        trace = simulate(both, "jigsaw", shapes=turns)[1]
        spans = {name: [span for span in trace.spans if span.pipeline == name] for name in ("short", "long")}
        assert max(span.end for span in spans["short"]) <= min(span.start for span in spans["long"])
        assert all({span.device for span in spans[name]} == set(range(8)) for name in spans)
        alone = 0.0
        for spec in specs:
            one = planner_scenarios.scenario(spec, devices=8, steps=2, policies=("jigsaw",))
            shape = on_slice(base_shape(turns[spec["name"]]), 0)
            alone += simulate(one, "jigsaw", shapes={spec["name"]: shape})[1].makespan
        assert trace.makespan == pytest.approx(alone, rel=1e-6)


@pytest.mark.parametrize("pipelines", [1, 2, 3, 4, 8])
def test_jigsaw_is_never_below_verl_sync_whatever_the_number_of_pipelines(pipelines):
    """JigsawRL's point is many pipelines on one pool. jigsaw's search considers every pipeline on its own sub-pool
    sized by its work (the arrangement verl-sync gives, with verl-sync's even slices too) beside the whole pool shared,
    so it is never predicted below verl-sync: pipelines of different work (batch, response lengths) on 8 H100s."""
    specs = [
        planner_scenarios.lm_pipeline(
            name=f"lm{i}",
            batch=(16, 32)[i % 2],
            prompt_length=128,
            lengths={"kind": "lognormal", "median": (150, 500)[i // 2 % 2], "sigma": 0.9},
            length_bands=[512, 1024],
        )
        for i in range(pipelines)
    ]
    scenario = planner_scenarios.scenario(*specs, devices=8, steps=2, policies=("verl-sync", "jigsaw"))
    jigsaw, verl = (rate(simulate(scenario, policy)[1]) for policy in ("jigsaw", "verl-sync"))
    assert at_least(jigsaw, verl), (jigsaw, verl)


def dominating_pairs(devices) -> list[tuple[str, str]]:
    """(faster, slower) of every pair of `devices` where the first dominates (`catalog.dominates`)."""
    return [(a, b) for a in devices for b in devices if a != b and dominates(lookup_device(a), lookup_device(b))]


def on_device(scenario: Scenario, device: str) -> Scenario:
    return scenario.model_copy(update={"cluster": scenario.cluster.model_copy(update={"device": device})})


def test_digen_considers_the_same_cuts_on_devices_that_differ_only_in_speed():
    """Which cuts digen's search simulates does not depend on the device's speed (it ranks them on one device): on
    H200 (H100's compute, more bandwidth and memory), digen+tcss on digen-qwenimage-32 once never considered the shape
    it wins with on H100 and was predicted slower (12.57 vs 13.08 samples/s)."""
    scenario = load_scenario("digen-qwenimage-32")
    spec, devices = scenario.pipelines[0], scenario.cluster.devices

    def considered(device: str) -> list:
        return digen_search.finalists(spec, devices, None, CostModel(device), tcss=True)

    assert {lookup_device(name).memory_bytes for name in ("H100", "H800", "A100-80G")} == {80e9}
    assert considered("H800") == considered("H100") == considered("A100-80G")
    wins_on_h100 = digen_search.DigenShape(32, 2, False, 16, trainer_group=8, tag=True, tcss=True)
    assert wins_on_h100 in considered("H100") and wins_on_h100 in considered("H200")


@pytest.mark.parametrize(
    "name, policy",
    [
        ("calib-qwenimage-4xh200", "digen"),
        ("calib-qwenimage-4xh200", "digen+tcss"),
        ("calib-qwenimage-4xh200", "colocated-hsdp"),
        ("calib-qwenimage-lora-4xh800", "digen+tcss"),
        ("jigsaw-mixed-0.6b-8b", "jigsaw"),
    ],
)
def test_a_faster_device_is_never_predicted_slower(name, policy):
    """Every searching policy on shipped scenarios, on every catalogue device where the run fits: for every pair
    where one device dominates the other (faster at everything, as much memory or more), the faster one's samples/s
    is at least the slower one's."""
    scenario = load_scenario(name)
    cuda = [name for name, device in DEVICES.items() if device.platform == "cuda"]
    rates = {}
    for device in cuda:
        try:
            rates[device] = rate(simulate(on_device(scenario, device), policy)[1])
        except ValueError:  # does not fit this device's memory
            rates[device] = None
    assert sum(r is not None for r in rates.values()) >= 3
    for faster, slower in dominating_pairs(cuda):
        if rates[slower] is not None:
            assert rates[faster] is not None and at_least(rates[faster], rates[slower]), (faster, slower, rates)


def test_a_field_a_run_fixes_leaves_the_rest_of_the_search_to_the_policy():
    """colocated-hsdp with old log-probs not recomputed still chooses between one FSDP group and HSDP groups of a
    node (it once built the one-group shape and searched nothing), and every candidate it simulated keeps the field."""
    spec = planner_scenarios.flow_pipeline(prompts=16, group=2)
    scenario = planner_scenarios.scenario(spec, devices=16, steps=2, policies=("colocated-hsdp",))
    searched: list[Searched] = []
    prepared = prepare(scenario, "colocated-hsdp", searched=searched, recompute_logprob=False)
    groups = {shape.group for s in searched for shape in s.shapes.values()}
    assert groups == {16, 8}
    assert all(not shape.recompute_logprob for s in searched for shape in s.shapes.values())
    assert not prepared.setup.shapes["p"].recompute_logprob
    assert any(s.shapes == prepared.setup.shapes for s in searched)


def test_jigsaw_weighs_the_split_pool_with_each_language_model_s_tail_migrating_home_and_in_stages():
    """On sub-pools of their own nothing of another pipeline fills a pipeline's idle devices, so jigsaw simulates
    each split also with the LM tails kept home and with the LM steps in stages (verl-sync's cut): on a CPU core,
    work streamed beside the decode runs slower than after it."""
    _, _, searched = short_and_long_searched()
    split = [s.shapes for s in searched if len({sub_pool(shape) for shape in s.shapes.values()}) == 2]
    cuts = {(shape.migrate_at is None, shape.stream) for shapes in split for shape in shapes.values()}
    assert cuts == {(False, True), (True, True), (True, False)}
