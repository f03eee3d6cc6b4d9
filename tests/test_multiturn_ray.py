"""Multi-turn (env) runs on the Ray runtime (`pipelines.lm.engines`: an env run's decode rolls each trajectory out
whole on its device's rollout engine, with the environment process its engines hold): the on-policy policies end at
the reference loop's parameters for the same trajectories, to the bit, with the same rewards and episode figures,
alone or multiplexed with a flow pipeline; the asynchronous ones bound their staleness and train every trajectory
once; a worker killed mid-trajectory loses no turn; an env step's graph decodes each shard in one band and never
migrates."""

import json
import threading
from pathlib import Path

import fault_injection
import pytest
import ray
import torch
import yaml
from running import train
from safetensors.torch import load_file
from test_runtime_lm import same_bits
from two_pipelines import FLOW

from dovetail.config.common import ConfigError, scheduling_policies
from dovetail.config.load import parse_config
from dovetail.cost.model import CostModel
from dovetail.graph.lm import LMShape, build_lm
from dovetail.graph.node import Kind
from dovetail.pipelines.lm.messages import Prefill
from dovetail.runtime.executor import OFF_DEVICE
from dovetail.runtime.launch import AUTO_TIE
from dovetail.sched.jigsaw import Jigsaw, rollout_shares

STEPS = 2
CALC = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "calc.yaml").read_text()) | {
    "algo": {"prompts_per_step": 4, "group_size": 4, "micro_batches": 2},
    "eval": {"prompts": 4, "every": 100},
    "runtime": {"profile_samples": 4},
    "train": {"lr": 1e-3},
    "checkpoint": {"every": 100},
}
"""The shipped calc config (the calc task's model and the arithmetic environment), a small batch of it."""
EPISODES = ("env/turns", "env/tool_calls", "env/tool_errors", "env/unfinished")
REWARDS = ("reward/total", "reward/env", "reward_std", "frac_reward_zero_std")
pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]


def calc(policy: str):
    return parse_config(CALC | {"policy": policy})


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out):
    return load_file(str(out / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    train(calc("reference"), out, steps=STEPS)
    return out


def assert_the_reference_s_run(reference, out) -> None:
    """`out` ends at the reference's parameters to the bit, its steps with the same rewards and episode figures."""
    expected, got = final_weights(reference), final_weights(out)
    start = load_file(str(calc("reference").model.checkpoint / "model.safetensors"))
    assert max((expected[k] - start[k]).abs().max().item() for k in expected) > 1e-4, "training moved the weights"
    assert same_bits(expected, got)
    lines, reference_lines = metrics(out), metrics(reference)
    for key in (*REWARDS, *EPISODES, "response_tokens"):
        assert [m[key] for m in lines] == [m[key] for m in reference_lines], key
    assert [m["loss"] for m in lines] == pytest.approx([m["loss"] for m in reference_lines], rel=1e-5)
    assert all(m["env/tool_calls"] > 0 for m in lines), "the base model calls its tool: the turns were decoded"
    assert [m["env/wait_s"] for m in lines] == [0.0] * STEPS  # no latency: no engine ever waited
    assert json.loads((out / "ledger.json").read_text())["problems"] == []


@pytest.mark.exactness
@pytest.mark.parametrize("policy", ["verl-sync", "jigsaw"])
def test_an_on_policy_env_run_ends_at_the_reference_parameters(policy, reference, tmp_path):
    train(calc(policy), tmp_path, steps=STEPS)
    assert_the_reference_s_run(reference, tmp_path)
    ran = json.loads((tmp_path / "run_profile.json").read_text())["node_seconds"]
    decodes = {node.split("/", 2)[2] for node in ran if "/decode/" in node}
    if policy == "verl-sync":
        assert decodes == {"decode/0/0", "decode/1/0"}  # two rollout engines, each its shard whole in one band


@pytest.mark.exactness
def test_an_env_run_multiplexed_with_a_flow_pipeline_ends_where_it_ends_alone(reference, tmp_path, monkeypatch):
    """jigsaw-greedy kept to the whole pool for both pipelines (as tests/test_multiplex.py does), so they share it."""
    monkeypatch.setattr(
        Jigsaw,
        "plan_shapes",
        classmethod(lambda cls, c: rollout_shares(c.specs, dict(c.shapes), c.costs, c.steps)),
    )
    pipelines = [{k: v for k, v in CALC.items() if k != "policy"} | {"name": "calc"}, FLOW | {"name": "digits"}]
    tree = {"kind": "multiplex", "policy": "jigsaw-greedy", "cluster": {"devices": 2}, "pipelines": pipelines}
    train(parse_config(tree), tmp_path, steps=STEPS)
    assert_the_reference_s_run(reference, tmp_path / "calc")
    assert json.loads((tmp_path / "digits" / "ledger.json").read_text())["problems"] == []
    spans = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    devices_of = {name: {e["tid"] for e in spans if e["name"].startswith(f"{name}:")} for name in ("calc", "digits")}
    assert devices_of["calc"] & devices_of["digits"], "the pipelines share the pool's devices"


@pytest.mark.parametrize(("policy", "bound"), [("streamrl", 1), ("areal", 4)])
def test_an_asynchronous_env_run_bounds_its_staleness_and_trains_every_trajectory_once(
    policy, bound, reference, tmp_path
):
    """Its first step rolls out on the base weights, as the reference's does: the same trajectories and figures.
    Later ones may roll out on older weights than they train (areal's proximal log-probs recomputed over the whole
    trajectory, the observation tokens masked as ever)."""
    summary = train(calc(policy), tmp_path, steps=STEPS + 1)
    lines = metrics(tmp_path)
    first, reference_first = lines[0], metrics(reference)[0]
    assert {key: first[key] for key in (*REWARDS, *EPISODES)} == {
        key: reference_first[key] for key in (*REWARDS, *EPISODES)
    }
    assert all(0 <= m["staleness"] <= bound for m in lines) and max(m["staleness"] for m in lines) >= 1
    assert summary["max_staleness"] <= bound
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["problems"] == [] and len(ledger["trained"]) == (STEPS + 1) * 4 * 4
    assert all(m["env/turns"] >= 1 for m in lines)


def test_an_env_run_decodes_each_shard_in_one_band_and_never_migrates():
    """Whatever the shape asks: a trajectory alternates turns with its environment's steps (`graph.lm.build_lm`)."""
    config = calc("verl-sync")
    (spec,) = config.scenario(1).pipelines
    assert spec.multi_turn
    cost = CostModel(config.cluster.device)
    nodes = build_lm(spec, 1, LMShape(2, 2, migrate_at=spec.max_length // 2), cost)
    decodes = [n for n in nodes if n.kind == Kind.DECODE]
    assert sorted(n.shard for n in decodes) == [0, 1] and {n.band for n in decodes} == {(0, spec.max_length)}
    assert not any(n.kind == Kind.MIGRATE for n in nodes)
    single = spec.model_copy(update={"multi_turn": False, "length_bands": [spec.max_length // 4]})
    migrating = build_lm(single, 1, LMShape(2, 2, migrate_at=spec.max_length // 2), cost)
    assert any(n.kind == Kind.MIGRATE for n in migrating)  # the same shape migrates a single-turn step


def test_auto_on_an_env_config_simulates_each_policy_on_its_turns_and_runs_the_fastest(tmp_path):
    """auto forecasts every LM policy on the run's profiled costs and its turns and waits (the profile's episodes'
    turns, env.latency), keeps the fastest predicted, and the run trains under it."""
    config = parse_config(CALC | {"policy": "auto", "env": CALC["env"] | {"latency": {"seconds": 0.05}}})
    train(config, tmp_path, steps=1)
    profile = json.loads((tmp_path / "run_profile.json").read_text())
    predicted = profile["auto"]["predicted"]
    assert set(predicted) == set(scheduling_policies("lm"))
    chosen = profile["auto"]["policy"]
    assert profile["policy"] == chosen and predicted[chosen] >= (1 - AUTO_TIE) * max(predicted.values())
    (line,) = metrics(tmp_path)
    assert line["step"] == 1 and line["env/turns"] >= 1 and line["env/wait_s"] > 0


def test_an_env_run_refuses_length_bands_in_one_line():
    with pytest.raises(ConfigError, match=r"runtime.length_bands: an env run decodes each trajectory whole"):
        parse_config(CALC | {"policy": "verl-sync", "runtime": {"length_bands": [8]}})


def test_a_worker_killed_mid_trajectory_loses_no_turn(reference, tmp_path):
    """Each environment step waits half a second (`env.latency`: a trajectory's tokens are the same whatever it
    waits), and a rollout device is killed a quarter of a second after its prefill of the second step handed its
    samples on: inside its decode, while its trajectories decode or wait between turns. The decode is sent again to
    the restarted device, whose rollout engine and environment process roll the shard's trajectories out again from
    their first turn: every trajectory trained once, with the turns, tool calls and parameters of the reference's."""
    killed: list[tuple[int, str]] = []

    def kill_mid_trajectory(executor, part):
        if not killed and isinstance(part.work, Prefill) and part.work.samples[0].step == 1:
            killed.append((part.device, part.node))
            threading.Timer(0.25, fault_injection.kill, (executor.worker_of(part),)).start()

    config = parse_config(CALC | {"policy": "verl-sync", "env": CALC["env"] | {"latency": {"seconds": 0.5}}})
    summary = train(config, tmp_path, steps=STEPS, after_part=kill_mid_trajectory)
    [(device, _)], ledger = killed, json.loads((tmp_path / "ledger.json").read_text())
    restarts = [(r["device"], r["during"]) for r in ledger["restarts"]]
    assert summary["restarts"] >= 1 and restarts == [(device, f"calc/1/decode/{device}/0")], restarts
    assert ledger["problems"] == []
    assert same_bits(final_weights(reference), final_weights(tmp_path))
    lines, reference_lines = metrics(tmp_path), metrics(reference)
    for key in (*REWARDS, *EPISODES):
        assert [m[key] for m in lines] == [m[key] for m in reference_lines], key
    assert all(m["env/wait_s"] > 0 for m in lines)  # the engines waited on their environments


def free(policy: str, **env):
    """`calc(policy)` with free waits (`env.free_waits`): each turn a node, the environment's steps off the devices."""
    return parse_config(CALC | {"policy": policy, "env": CALC["env"] | {"free_waits": True} | env})


@pytest.mark.exactness
@pytest.mark.parametrize("policy", ["verl-sync", "jigsaw"])
def test_an_on_policy_env_run_with_free_waits_ends_at_the_reference_parameters(policy, reference, tmp_path):
    """Each turn decodes in a node of its own, from where its trajectories stand (a kept cache continued, else
    re-prefilled), and the environment steps them off the devices between turns: the same trajectories as the
    reference's whole rollouts, to the bit. The graph covers env.max_turns turns per shard, whatever the episodes
    take (a turn whose trajectories all ended decodes nothing)."""
    train(free(policy), tmp_path, steps=STEPS)
    assert_the_reference_s_run(reference, tmp_path)
    ran = json.loads((tmp_path / "run_profile.json").read_text())["node_seconds"]
    turns = {node.split("/", 2)[2] for node in ran if node.split("/")[1] == "0" and "/turn/" in node}
    covered = range(1, free(policy).env.max_turns)
    assert turns == {f"turn/{shard}/{t}" for shard in (0, 1) for t in covered}, turns  # 2 shards, as many turns


@pytest.mark.parametrize(("policy", "bound"), [("streamrl", 1), ("areal", 4)])
def test_an_asynchronous_env_run_with_free_waits_trains_every_trajectory_once(policy, bound, reference, tmp_path):
    """Its first step rolls out on the base weights, as the reference's: the same trajectories, turn by turn."""
    summary = train(free(policy), tmp_path, steps=STEPS + 1)
    lines = metrics(tmp_path)
    assert {key: lines[0][key] for key in (*REWARDS, *EPISODES)} == {
        key: metrics(reference)[0][key] for key in (*REWARDS, *EPISODES)
    }
    assert summary["max_staleness"] <= bound
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["problems"] == [] and len(ledger["trained"]) == (STEPS + 1) * 4 * 4


def test_jigsaw_with_staleness_one_opens_a_step_while_the_one_before_trains(reference, tmp_path):
    """Two env pipelines sharing the pool under jigsaw with `staleness: 1`: each pipeline's first step rolls out on
    the base weights (the calc pipeline's the reference's trajectories and figures), each later step opens once the
    step before has begun its rollout, on the weights published then: one version behind, never more; every
    trajectory trains once."""
    entry = {k: v for k, v in CALC.items() if k != "policy"}
    tree = {
        "kind": "multiplex",
        "policy": "jigsaw",
        "arrangement": "shared",
        "staleness": 1,
        "cluster": {"devices": 2},
        "pipelines": [entry | {"name": "calc"}, entry | {"name": "other", "seed": 1}],
    }
    train(parse_config(tree), tmp_path, steps=STEPS + 1)
    first, reference_first = metrics(tmp_path / "calc")[0], metrics(reference)[0]
    assert {key: first[key] for key in (*REWARDS, *EPISODES)} == {
        key: reference_first[key] for key in (*REWARDS, *EPISODES)
    }
    for name in ("calc", "other"):
        lines = metrics(tmp_path / name)
        staleness = [m["staleness"] for m in lines]
        assert staleness[0] == 0 and max(staleness) == 1
        ledger = json.loads((tmp_path / name / "ledger.json").read_text())
        assert ledger["problems"] == [] and len(ledger["trained"]) == (STEPS + 1) * 4 * 4


@pytest.mark.exactness
def test_jigsaw_with_staleness_one_ends_where_streamrl_ends(tmp_path):
    """One env pipeline under jigsaw with `staleness: 1` opens each step on the weights streamrl opens it on (the
    first on the base weights, each later one on those published by the step two before it), so it rolls out the
    same trajectories, corrects them by the same decoupled weights, and ends at streamrl's parameters, though its
    trainer parts split over both devices where streamrl trains on one."""
    train(calc("streamrl"), tmp_path / "streamrl", steps=STEPS + 1)
    entry = {k: v for k, v in CALC.items() if k != "policy"} | {"name": "calc"}
    tree = {"kind": "multiplex", "policy": "jigsaw", "staleness": 1, "cluster": {"devices": 2}, "pipelines": [entry]}
    train(parse_config(tree), tmp_path / "jigsaw", steps=STEPS + 1)
    lines, streamrl = metrics(tmp_path / "jigsaw" / "calc"), metrics(tmp_path / "streamrl")
    for key in ("staleness", *REWARDS, *EPISODES):
        assert [m[key] for m in lines] == [m[key] for m in streamrl], key
    final = f"step_{STEPS + 1:06d}"
    expected = load_file(str(tmp_path / "streamrl" / "checkpoints" / final / "model.safetensors"))
    got = load_file(str(tmp_path / "jigsaw" / "calc" / "checkpoints" / final / "model.safetensors"))
    difference = torch.cat([(expected[name] - got[name]).abs().flatten() for name in expected])
    # the proximal log-probs are the trainer's own forward, batched otherwise on two devices: equal to rounding
    # (2e-7 at most here), where Adam may turn a rounding difference in a near-zero gradient into ~lr in a weight
    assert (difference > 1e-6).float().mean() < 1e-4 and difference.max() <= 2 * CALC["train"]["lr"] * (STEPS + 1)


@pytest.mark.exactness
def test_jigsaw_runs_another_pipeline_s_work_on_a_device_whose_trajectories_wait(reference, tmp_path, monkeypatch):
    """A multiplexed run with free waits: while the calc pipeline's trajectories of a shard wait on their environment
    (an env node, off the devices: 0.5 s each here), the device their turn ran on is jigsaw's to fill, and it puts
    the flow pipeline's work there, on the trace; the calc pipeline still ends at the reference's parameters (a
    wait changes when a turn decodes, never what). jigsaw-greedy kept to the whole pool for both pipelines (as
    tests/test_multiplex.py does), so they share it."""
    monkeypatch.setattr(
        Jigsaw,
        "plan_shapes",
        classmethod(lambda cls, c: rollout_shares(c.specs, dict(c.shapes), c.costs, c.steps)),
    )
    env = CALC["env"] | {"free_waits": True, "latency": {"seconds": 0.5}}
    calc_entry = {k: v for k, v in CALC.items() if k != "policy"} | {"name": "calc", "env": env}
    tree = {
        "kind": "multiplex",
        "policy": "jigsaw-greedy",
        "cluster": {"devices": 2},
        "pipelines": [calc_entry, FLOW | {"name": "digits"}],
    }
    train(parse_config(tree), tmp_path, steps=STEPS)
    assert same_bits(final_weights(reference), final_weights(tmp_path / "calc"))
    lines, reference_lines = metrics(tmp_path / "calc"), metrics(reference)
    for key in (*REWARDS, *EPISODES):
        assert [m[key] for m in lines] == [m[key] for m in reference_lines], key
    assert all(m["env/wait_s"] > 0 for m in lines)  # the env nodes waited their latency
    profile = json.loads((tmp_path / "run_profile.json").read_text())
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    # the waits of trajectories that went on took the latency, off the devices (a chain's waits after every
    # trajectory of its shard ended wait none)
    waits = [w for w in profile["waits"] if w["pipeline"] == "calc" and w["end"] - w["start"] >= 0.5]
    assert waits
    node_spans = {e["args"]["node"]: e for e in spans if e["cat"] != "switch"}
    filled = []
    for wait in waits:
        step, _, shard, turn = wait["node"].rsplit("/", 3)  # "calc/S", "env", shard, turn
        start, end = wait["start"] * 1e6, wait["end"] * 1e6
        before, after = node_spans[turn_node(step, shard, int(turn))], node_spans[turn_node(step, shard, int(turn) + 1)]
        assert before["ts"] + before["dur"] <= start + 1 and after["ts"] >= end - 1  # the wait is between its turns
        device = before["tid"]
        filled += [
            e
            for e in spans
            if e["tid"] == device and e["name"].startswith("digits:") and e["ts"] < end and e["ts"] + e["dur"] > start
        ]
    assert filled, "the flow pipeline's work ran on a device while calc's trajectories from there waited"


def turn_node(step: str, shard: str, turn: int) -> str:
    """The id of a shard's turn node (`graph.lm._turns`): its first turn is the decode node, later ones turn nodes."""
    return f"{step}/decode/{shard}/0" if turn == 0 else f"{step}/turn/{shard}/{turn}"


def test_a_worker_killed_mid_trajectory_with_free_waits_loses_no_turn(reference, tmp_path):
    """Free waits: a rollout device is killed a quarter of a second after its prefill of the second step handed its
    episodes on (reset off the devices), while its shard's first turn decodes or its trajectories wait half a
    second on their environment, whose episodes live off the devices and outlive it. The turn sent to the restarted
    device decodes from where its trajectories stand (in the object store), re-prefilled there: every trajectory
    trained once, with the turns, tool calls and parameters of the reference's."""
    killed: list[tuple[int, str]] = []

    def kill_mid_trajectory(executor, part):
        if not killed and isinstance(part.work, Prefill) and part.work.samples[0].step == 1:
            killed.append((part.device, part.node))
            threading.Timer(0.25, fault_injection.kill, (executor.worker_of(part),)).start()

    summary = train(free("verl-sync", latency={"seconds": 0.5}), tmp_path, steps=STEPS, after_part=kill_mid_trajectory)
    [(device, _)], ledger = killed, json.loads((tmp_path / "ledger.json").read_text())
    restarts = [(r["device"], r["during"]) for r in ledger["restarts"]]
    assert summary["restarts"] == 1 and restarts[0][0] == device, restarts
    assert restarts[0][1].startswith("calc/1/") and "/env/" not in restarts[0][1], restarts  # a turn of step 1
    assert ledger["problems"] == []
    assert same_bits(final_weights(reference), final_weights(tmp_path))
    lines, reference_lines = metrics(tmp_path), metrics(reference)
    for key in (*REWARDS, *EPISODES):
        assert [m[key] for m in lines] == [m[key] for m in reference_lines], key
    assert all(m["env/wait_s"] > 0 for m in lines)  # the env nodes waited, off the devices


def test_an_environment_worker_killed_mid_run_loses_no_turn(reference, tmp_path):
    """Free waits: the pipeline's EnvironmentWorker (its episodes, off the devices) is killed a quarter of a second
    after the prefill of the second step handed its episodes on, while its trajectories' first turn decodes or they
    wait half a second on it. Ray restarts it and sends it the calls it had in flight; it opens each episode again
    from the trajectory a call carries (reset, then its earlier turns replayed): the run goes on with the turns, tool
    calls, rewards and parameters of the reference's."""
    armed: list[threading.Timer] = []
    killed: list[int] = []
    answered_by: set[int] = set()

    def kill_mid_run(executor, part):
        if part.device == OFF_DEVICE:  # an env node's call answered: by which incarnation
            answered_by.add(ray.get(executor.environments["calc"].ping.remote()))
        if not armed and isinstance(part.work, Prefill) and part.work.samples[0].step == 1:
            worker = executor.environments["calc"]
            armed.append(threading.Timer(0.25, lambda: killed.append(fault_injection.kill(worker))))
            armed[0].start()

    summary = train(free("verl-sync", latency={"seconds": 0.5}), tmp_path, steps=STEPS, after_part=kill_mid_run)
    assert len(killed) == 1 and killed[0] in answered_by and len(answered_by) == 2, (killed, answered_by)
    assert summary["restarts"] == 0  # no device restarted: only the environments' worker
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []
    assert same_bits(final_weights(reference), final_weights(tmp_path))
    lines, reference_lines = metrics(tmp_path), metrics(reference)
    for key in (*REWARDS, *EPISODES):
        assert [m[key] for m in lines] == [m[key] for m in reference_lines], key
