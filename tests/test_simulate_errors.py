"""`dovetail simulate` prints every policy's row: numbers, or one line saying why the policy cannot run the scenario
and what to change; never a traceback. `dovetail plan` stays fast on the 64-GPU scenario."""

import json

import planner_scenarios
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.graph.node import Kind, Role
from dovetail.plan.prepare import simulate
from dovetail.plan.report import compare
from dovetail.plan.scenario import Scenario
from dovetail.sched import POLICIES

runner = CliRunner()

LONGEST_LINE = 500


def lm(devices: int, model: str = "Qwen3-0.6B", tensor_parallel: int = 1, policies=("verl-sync",)) -> Scenario:
    pipeline = planner_scenarios.lm_pipeline(
        model=model,
        prompt_length=150,
        lengths={"kind": "lognormal", "median": 220, "sigma": 1.0},
        tensor_parallel=tensor_parallel,
    )
    return planner_scenarios.scenario(pipeline, name="one-lm", devices=devices, steps=2, policies=policies)


def flow(devices: int, policies=("colocated",), schedule=None, **pipeline) -> Scenario:
    pipeline = planner_scenarios.flow_pipeline(**{"prompts": 4, **pipeline})
    schedule = {"steps": 2, "policies": policies, **(schedule or {})}
    return planner_scenarios.scenario(pipeline, name="one-flow", devices=devices, **schedule)


def test_jigsaw_runs_the_calibration_scenario_it_used_to_stall_on():
    """A later step's longest micro-batch needs more trainer memory than the first's: the rollout share is sized for
    every step the run trains, so the trainer node fits and the run ends."""
    result = runner.invoke(app, ["simulate", "calib-qwen3-4b-gsm8k", "--policies", "jigsaw,jigsaw-greedy", "--json"])
    assert result.exit_code == 0, result.output
    for row in json.loads(result.output)["policies"].values():
        assert row["samples_per_s"] > 0


def test_jigsaw_runs_a_single_language_model_pipeline_on_one_and_two_devices():
    for devices, tensor_parallel in ((1, 1), (2, 1), (2, 2)):
        for policy in ("jigsaw", "jigsaw-greedy"):
            _, trace = simulate(lm(devices, tensor_parallel=tensor_parallel), policy)
            assert [r.step for r in trace.steps] == [0, 1]
            assert {span.device for span in trace.spans} == set(range(devices))


def test_every_policy_gets_a_row_and_one_that_cannot_run_says_why():
    result = runner.invoke(
        app, ["simulate", "calib-qwen3-4b-gsm8k", "--policies", "verl-sync,digen,streamrl,jigsaw", "--steps", "1"]
    )
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines()[3:]}
    assert list(rows) == ["verl-sync", "digen", "streamrl", "jigsaw"]
    assert " 1.00x " in rows["verl-sync"] and "x " in rows["jigsaw"] and "cannot" not in rows["jigsaw"]
    assert rows["digen"].startswith("digen            cannot run: policy digen schedules flow pipelines")
    assert "streamrl splits the pipeline's 4 devices" in rows["streamrl"]


def test_a_scenario_no_policy_can_run_exits_2_with_each_reason():
    result = runner.invoke(app, ["simulate", "calib-qwen3-4b-gsm8k", "--policies", "digen,colocated"])
    assert result.exit_code == 2
    assert result.output.count("cannot run: policy") == 2


def test_two_pools_on_one_device_say_how_many_devices_they_need():
    reasons = compare(flow(1, ("colocated", "disaggregated", "digen")), steps=1)["policies"]
    assert reasons["colocated"]["samples_per_s"] > 0 and reasons["digen"]["samples_per_s"] > 0
    message = reasons["disaggregated"]["error"]
    assert "need at least 2 devices" in message and "cluster.devices" in message and "colocated" in message
    assert "trainer_devices=0" not in message


def test_a_split_lm_policy_on_too_few_devices_says_how_many_it_needs():
    reasons = compare(lm(1, policies=("verl-sync", "streamrl", "areal", "jigsaw")), steps=1)["policies"]
    assert reasons["verl-sync"]["samples_per_s"] > 0 and reasons["jigsaw"]["samples_per_s"] > 0
    for policy in ("streamrl", "areal"):
        message = reasons[policy]["error"]
        assert "so it needs 2" in message and "verl-sync or jigsaw" in message, message
        assert "fits the trainer" not in message
    message = compare(lm(2, tensor_parallel=2, policies=("streamrl",)), steps=1)["policies"]["streamrl"]["error"]
    assert "tensor_parallel=2" in message and "so it needs 3" in message


def test_a_trainer_too_large_for_any_split_names_its_memory():
    message = compare(lm(2, model="Qwen3-8B", policies=("areal",)), steps=1)["policies"]["areal"]["error"]
    assert "trainer needs" in message and "GB per device even on 1 trainer device" in message
    assert "add devices" in message


def test_a_replicated_trainer_too_large_for_a_device_is_told_to_shard_not_to_add_devices():
    """A replica holds the whole trainer state on every trainer device, so more devices never make it fit: every
    policy says so, and names the one field that does (`replicated_trainer: false`, checked by `what_fits`)."""
    scenario = lm(8, model="Qwen3-8B", policies=("verl-sync", "streamrl", "areal", "jigsaw"))
    pipeline = scenario.pipelines[0].model_copy(update={"replicated_trainer": True})
    scenario = scenario.model_copy(update={"pipelines": [pipeline]})
    for policy, row in compare(scenario, steps=1)["policies"].items():
        message = row["error"]
        assert message.endswith("it fits with pipelines.0.replicated_trainer=false"), (policy, message)
        assert "add devices" not in message and "more devices" not in message, (policy, message)
    sharded = scenario.model_copy(update={"pipelines": [pipeline.model_copy(update={"replicated_trainer": False})]})
    assert all(row["samples_per_s"] > 0 for row in compare(sharded, steps=1)["policies"].values())


def test_jigsaw_says_when_resident_trainers_leave_no_room_for_the_rollout_weights():
    message = compare(lm(2, model="Qwen3-8B", policies=("jigsaw",)), steps=1)["policies"]["jigsaw"]["error"]
    assert "leaves" in message and "its weights (16 GB at tensor_parallel=1)" in message and "add devices" in message


def test_a_field_a_policy_decides_itself_is_refused_by_name():
    chunked = compare(flow(4, ("colocated", "disaggregated", "digen"), tsp_chunk=2), steps=1)["policies"]
    for policy in ("colocated", "disaggregated"):
        message = chunked[policy]["error"]
        assert message.startswith(f"pipelines.0.tsp_chunk=2: policy {policy} trains one timestep per"), message
        assert "digen" in message
    assert chunked["digen"]["samples_per_s"] > 0
    fragmented = compare(flow(4, ("colocated",), fragments=2), steps=1)["policies"]["colocated"]["error"]
    assert fragmented.startswith("pipelines.0.fragments=2: policy colocated splits")
    proximal = lm(4, policies=("areal",)).model_dump(mode="json")
    proximal["pipelines"][0]["recompute_logprob"] = False
    message = compare(Scenario.model_validate(proximal), steps=1)["policies"]["areal"]["error"]
    assert message.startswith("pipelines.0.recompute_logprob=False: policy areal recomputes") and "streamrl" in message
    pooled = compare(flow(4, ("colocated", "disaggregated"), {"trainer_devices": 1}), steps=1)["policies"]
    assert pooled["colocated"]["error"].startswith("schedule.trainer_devices=1: policy colocated trains on every")
    assert pooled["disaggregated"]["samples_per_s"] > 0


def test_an_unknown_policy_in_a_scenario_is_named_when_it_is_read(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: s\ncluster: {device: H100, devices: 2}\nschedule: {policies: [colocated, fastest]}\n"
        "pipelines:\n  - {kind: flow, name: p, model: SD3.5-M, prompts: 4, group: 2, denoising_steps: 4, "
        "trained_timesteps: 2, height: 256, width: 256}\n"
    )
    result = runner.invoke(app, ["simulate", str(path)])
    assert result.exit_code == 2 and "schedule.policies: unknown policies ['fastest']" in result.output


# --- hypothesis: no scenario ends in a traceback --------------------------------------------------------------

ROWS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

small = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["flow", "lm"]),
        "devices": st.integers(1, 4),
        "flow_model": st.sampled_from(["SD3.5-M", "FLUX.1-12B"]),
        "lm_model": st.sampled_from(["Qwen3-0.6B", "Qwen3-4B", "Qwen3-8B"]),
        "tensor_parallel": st.sampled_from([1, 2, 4]),
        "tsp_chunk": st.sampled_from([None, None, None, 1, 3]),  # mostly unset: most scenarios leave them to the policy
        "fragments": st.sampled_from([None, None, None, 2, 4]),
        "trainer_devices": st.sampled_from([None, None, None, 1, 2]),
        "reward_devices": st.sampled_from([0, 0, 0, 1]),
    }
)


@ROWS
@given(small)
def test_every_small_scenario_gets_numbers_or_a_one_line_reason_per_policy(case):
    base = flow(case["devices"]) if case["kind"] == "flow" else lm(case["devices"])
    data = base.model_dump(mode="json")
    pipeline = data["pipelines"][0]
    if case["kind"] == "flow":
        pipeline.update(model=case["flow_model"], tsp_chunk=case["tsp_chunk"], fragments=case["fragments"])
    else:
        pipeline.update(model=case["lm_model"], tensor_parallel=case["tensor_parallel"])
    data["schedule"].update(
        policies=sorted(POLICIES), trainer_devices=case["trainer_devices"], reward_devices=case["reward_devices"]
    )
    try:
        scenario = Scenario.model_validate(data)
    except ValueError as error:  # pools that do not fit the cluster: named when the scenario is read
        assert "schedule." in str(error)
        return
    result = compare(scenario, steps=1)
    assert list(result["policies"]) == sorted(POLICIES)
    for name, row in result["policies"].items():
        if "error" in row:
            assert "\n" not in row["error"] and len(row["error"]) <= LONGEST_LINE, (name, row["error"])
        else:
            assert row["samples_per_s"] > 0, name


def refusal_gb(scenario: Scenario, policy: str) -> float:
    """The GB per device a memory refusal names (the simulation refused with one line)."""
    with pytest.raises(ValueError) as error:
        simulate(scenario, policy, steps=1)
    message = str(error.value)
    assert "\n" not in message and " GB per device under " in message
    return float(message.split(" needs ")[1].split(" GB")[0])


def test_a_language_model_memory_refusal_names_micro_batches_and_raising_them_lowers_the_figure():
    """An LM pipeline has no offload; its trainer pass holds batch / micro_batches sequences' activations."""
    long = {"kind": "lognormal", "median": 8000, "sigma": 0.5}

    def scenario(micro_batches: int) -> Scenario:
        spec = planner_scenarios.lm_pipeline(
            model="Qwen3-8B", batch=64, group=8, max_length=16384, lengths=long, micro_batches=micro_batches
        )
        return planner_scenarios.scenario(spec, devices=2, policies=("verl-sync",))

    with pytest.raises(ValueError) as error:
        simulate(scenario(1), "verl-sync", steps=1)
    assert "raise micro_batches (now 1" in str(error.value) and "offload" not in str(error.value)
    assert refusal_gb(scenario(4), "verl-sync") < refusal_gb(scenario(1), "verl-sync") / 3


def test_a_1024_image_group_generates_in_chunks_that_fit():
    """One prompt x 1024 images of Qwen-Image at 1024x1024: one pass of the whole group would need ~500 GB of
    activations per device at any device count; engines batch it in chunks, and so does the planner: every generate
    node fits beside the rollout engine, and a chunk of the group needs no more than the whole device."""
    spec = planner_scenarios.flow_pipeline(model="QwenImage-20B", prompts=1, group=1024, mini_batches=1)
    spec |= {"height": 1024, "width": 1024, "offload": True}
    scenario = planner_scenarios.scenario(spec, devices=8, policies=("colocated",))
    prepared, trace = simulate(scenario, "colocated", steps=1)
    capacity = prepared.setup.memory_gb
    rollout = prepared.setup.engines["p"].resident_gb[Role.ROLLOUT]
    generates = [node for node in prepared.graph if node.kind == Kind.GENERATE]
    assert generates and all(rollout + node.memory_gb <= capacity for node in generates)
    assert trace.steps


def test_a_generation_refusal_names_a_fix_that_lowers_the_figure():
    """Where the rollout engine alone does not fit (Qwen-Image's 20B and its text encoder on a 40 GB A100), the refusal
    names a larger device (or a smaller image), not offload (the rollout engine is not sharded)."""
    spec = planner_scenarios.flow_pipeline(model="QwenImage-20B", offload=True)
    scenario = planner_scenarios.scenario(spec, device="A100-40G", devices=4, policies=("colocated",))
    with pytest.raises(ValueError) as error:
        simulate(scenario, "colocated", steps=1)
    message = str(error.value)
    assert "generate needs" in message and "use a device with more memory" in message and "offload" not in message
    rollout_gb = float(message.split(" needs ")[1].split(" GB")[0])
    larger = planner_scenarios.scenario(spec, device="A100-80G", devices=4, policies=("colocated",))
    assert simulate(larger, "colocated", steps=1)[1].steps, f"fits the larger device ({rollout_gb:.0f} GB needed)"
