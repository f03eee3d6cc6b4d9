"""Every placement a policy's search emits fits the memory the simulator checks, over the shipped scenarios, every
policy their kinds allow (`plan.report.allowed_policies`), pools of 8 to 256 devices and the catalogue's devices; a
plan that cannot fit is refused in one line that names the scenario value making it fit, and that value does
(issue 38).

The sweep is sampled to stay within a minute or so on one core: every scenario and policy on 8 of its own devices,
one scenario of each kind over every pool size, and one of each kind on 16 of each device type. Each plan is simulated
over `STEPS` steps: the simulator (`plan.state.ClusterState._check_devices`) refuses any decision that would put more
on a device than its memory, and a search simulates every candidate it weighs the same way, so an infeasible
candidate or placement surfaces as that refusal (a `DecisionError`), which no test here lets through."""

import re

import pytest

from dovetail.plan.prepare import prepare, run_prepared
from dovetail.plan.report import allowed_policies
from dovetail.plan.scenario import Scenario, list_scenarios, load_scenario, parse_scenario
from dovetail.plan.state import DecisionError
from dovetail.sched.policy import MemoryRefusal

pytestmark = pytest.mark.slow

STEPS = 2
"""Simulated steps per plan: the second step is where overlapped and lent placements first meet the first's."""

POOLS = (8, 16, 32, 64, 128, 256)
DEVICE_TYPES = ("A100-40G", "L40S", "H200", "Ascend-910B")
REMEDY = re.compile(r"; it fits with ((?:cluster\.device=[\w.-]+ and )?[\w.]+=[\w.-]+)$")
"""The end of a memory refusal: the scenario change (one field, or a device and a pool) that makes it fit."""
FIELD_VALUE = re.compile(r"\b[a-z_]+(?:\.[a-z_0-9]+)*=\S+")


def on(scenario: Scenario, device: str) -> Scenario:
    cluster = scenario.cluster.model_copy(update={"device": device, "network_gbps": None})
    return scenario.model_copy(update={"cluster": cluster})


def changed(scenario: Scenario, devices: int, remedy: str) -> tuple[Scenario, int]:
    """The scenario and pool with a refusal's `field=value` changes applied, through the scenario's own validation."""
    data = scenario.model_dump(exclude_none=True)
    for change in remedy.split(" and "):
        field, _, value = change.partition("=")
        if field == "cluster.devices":
            devices = int(value)
            continue
        *path, last = field.split(".")
        section = data
        for part in path:
            section = section[int(part)] if part.isdigit() else section[part]
        section[last] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return parse_scenario(data), devices


def outcome(scenario: Scenario, policy: str, devices: int) -> str | None:
    """Plan and simulate `policy` on `devices`: None when it ran with every device within its memory, else the
    refusal, checked to be one line naming a field and value (a memory refusal: the value that makes it fit)."""
    try:
        prepared = prepare(scenario, policy, steps=STEPS, devices=devices)
        trace = run_prepared(scenario, prepared)
    except DecisionError as error:
        pytest.fail(f"{scenario.name} {policy} on {devices}: a placement the simulator refuses: {error}")
    except ValueError as refusal:
        line = str(refusal)
        assert "\n" not in line, line
        if isinstance(refusal, MemoryRefusal):
            assert REMEDY.search(line), f"{scenario.name} {policy} on {devices}: no value that fits in {line!r}"
        else:
            assert FIELD_VALUE.search(line), f"{scenario.name} {policy} on {devices}: names no field value: {line!r}"
        return line
    assert max(trace.peak_memory_gb) <= prepared.setup.memory_gb + 1e-9
    return None


def sweep(scenario: Scenario, pools) -> list[tuple[str, int, str]]:
    """Every allowed policy on every pool (at least the plan's minimum); the memory refusals met."""
    least = scenario.pipelines[0].min_plan_devices + scenario.schedule.reward_devices
    refused = []
    for devices in (n for n in pools if n >= least):
        for policy in allowed_policies(scenario):
            line = outcome(scenario, policy, devices)
            if line is not None and REMEDY.search(line):
                refused.append((policy, devices, line))
    return refused


@pytest.mark.parametrize("name", sorted(list_scenarios()))
def test_every_policy_on_8_devices_places_within_memory(name):
    """The smallest pool the sweep plans, where memory is tightest: each device holds the largest shard."""
    sweep(load_scenario(name), (8,))


@pytest.mark.parametrize("name", ["calib-qwenimage-64xh100", "jigsaw-qwen3-0.6b-16xh100"])
def test_every_pool_from_8_to_256_places_within_memory(name):
    """One scenario of each kind (flow, LM) on every pool size."""
    sweep(load_scenario(name), POOLS)


@pytest.mark.parametrize("device", DEVICE_TYPES)
@pytest.mark.parametrize("name", ["calib-qwenimage-lora-4xh800", "jigsaw-64xa100"])
def test_every_device_type_places_within_memory_or_says_what_fits(name, device):
    """Where a device's memory is too small the refusal's value is checked too: the changed scenario plans."""
    scenario = on(load_scenario(name), device)
    for policy, devices, line in sweep(scenario, (16,)):
        remedy = REMEDY.search(line)
        assert remedy is not None
        fitted, pool = changed(scenario, devices, remedy.group(1))
        assert outcome(fitted, policy, pool) is None, f"{line!r} does not fit"


def test_lending_a_trainer_device_leaves_room_for_the_fragment():
    """The issue's case: QwenImage with CFG on 32 H100s, where both engines (77.8 GB) fit a trainer device but a
    fragment's activations beside them (3.4 GB) do not. digen+tcss's search lent such a device (TAG), and the plan
    failed with "device 16 would hold 81.2 GB of 80.0 GB"; it must lend only where the fragment fits too."""
    scenario = load_scenario("digen-qwenimage-32")
    with_cfg = scenario.model_copy(update={"pipelines": [scenario.pipelines[0].model_copy(update={"cfg": True})]})
    for policy in ("digen", "digen+tcss"):
        assert outcome(with_cfg, policy, 32) is None
