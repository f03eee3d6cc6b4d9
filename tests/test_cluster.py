"""The Ray runtime on a cluster of several nodes (`ray.cluster_utils.Cluster` on this machine: a head without devices
and three nodes of one `dovetail_device` each, every server on loopback). A run given `cluster.address` puts its
device workers on two nodes and ends at the reference's parameters, for a flow pipeline, a language model and both
multiplexed; a node that holds a worker is removed mid-run: with a spare node the worker comes back there, without
one the run goes on on the devices that remain, after `cluster.lost_after_s`, and says so in one line."""

import contextlib
import json
import time

import psutil
import pytest
import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster
from ray.experimental import internal_kv
from running import train
from two_pipelines import FLOW, LM, STEPS, final_weights, same_parameters

from dovetail.config.load import parse_config
from dovetail.runtime.launch import by_node
from dovetail.runtime.ray_start import DEVICE_RESOURCE, LOOPBACK, RAY_NAMESPACE
from dovetail.runtime.rendezvous import NAMESPACE

pytestmark = pytest.mark.slow

LOST_AFTER_S = 3.0
NODE_DEATH_DETECTION = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
"""Ray declares a node dead after this many failed health checks (by default 5 at 3 s: 15 s and more)."""
DETECTION_S = 0.5 * 3


@pytest.fixture(scope="module")
def cluster():
    """A head without devices and three one-device nodes, on loopback; this process is the runs' driver. A Ray
    instance of an earlier test in this process is left first (a process drives one Ray instance at a time)."""
    ray.shutdown()
    cluster_mode, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False  # loopback nodes
    try:
        head = {"num_cpus": 1, "node_ip_address": LOOPBACK, "_system_config": NODE_DEATH_DETECTION}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(3):
            cluster.add_node(num_cpus=0, resources={DEVICE_RESOURCE: 1}, node_ip_address=LOOPBACK)
        ray.init(address=cluster.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """Each pipeline's final parameters trained alone by the reference loop (one process, no Ray)."""
    weights = {}
    for name, tree in (("sort", LM), ("digits", FLOW)):
        out = tmp_path_factory.mktemp(f"alone-{name}")
        train(parse_config(tree | {"policy": "reference"}), out, steps=STEPS)
        weights[name] = final_weights(out)
    return weights


def on_cluster(cluster, tree: dict, policy: str, **settings) -> dict:
    return tree | {"policy": policy, "cluster": {"devices": 2, "address": cluster.address, **settings}}


def worker_nodes() -> list[str]:
    """The node of each device of the job's pool, by device (its placement groups' bundles, in order)."""
    groups = sorted(
        (table for table in ray.util.placement_group_table().values() if table["state"] != "REMOVED"),
        key=lambda table: int(table["name"].rsplit("from", 1)[1]),
    )
    return [node for table in groups for _, node in sorted(table["bundles_to_node_id"].items())]


@pytest.mark.parametrize(
    ("trees", "policy"),
    [((LM,), "verl-sync"), ((LM, FLOW), "jigsaw")],  # a flow run alone: the next tests, before a node goes
    ids=["lm-verl-sync", "multiplexed-jigsaw"],
)
def test_a_run_spread_over_two_nodes_ends_at_the_reference_parameters(cluster, alone, trees, policy, tmp_path):
    if len(trees) == 1:
        tree = on_cluster(cluster, trees[0], policy)
    else:
        tree = on_cluster(cluster, {"kind": "multiplex", "pipelines": list(trees)}, policy)
    train(parse_config(tree), tmp_path, steps=STEPS)
    assert len(set(worker_nodes()[:2])) == 2, "the run's two devices are on two nodes"
    names = ["sort", "digits"] if len(trees) == 2 else ["sort"]
    for name in names:
        run_dir = tmp_path / name if len(trees) == 2 else tmp_path
        assert same_parameters(name, alone[name], final_weights(run_dir)), name
        assert json.loads((run_dir / "ledger.json").read_text())["problems"] == []
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == STEPS
    spans = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    devices_of = [{e["tid"] for e in spans if e["name"].startswith(f"{name}:")} for name in names]
    assert set.union(*devices_of) == {0, 1}, "the run's work is on both nodes' devices"


def test_a_sharded_trainer_in_groups_of_a_node_replicated_across_nodes_ends_at_the_reference(cluster, alone, tmp_path):
    """HYBRID: `train.sharding: fsdp` with digen's trainer groups of one device (`runtime.trainer_group=1`), a group
    on each node: each group an FSDP group holding the whole trainer (a node's devices), training its own nodes, the
    groups replicas of each other, whose members add their shards' gradients across the nodes at each commit. The
    run ends at the reference's parameters, and both nodes trained."""
    tree = FLOW | {"train": {"sharding": "fsdp"}, "runtime": FLOW["runtime"] | {"trainer_group": 1}}
    train(parse_config(on_cluster(cluster, tree, "digen")), tmp_path, steps=STEPS)
    assert len(set(worker_nodes()[:2])) == 2, "the run's two devices are on two nodes"
    assert same_parameters("digits", alone["digits"], final_weights(tmp_path))
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []
    spans = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in spans if e["name"] == "digits:train"} == {0, 1}, "each node's group trained"


def test_a_run_publishing_by_broadcast_across_nodes_ends_at_the_reference_parameters(cluster, alone, tmp_path):
    """cluster.publication=collective: every publication reaches the rollout device on the other node by a broadcast
    from the trainer replica (fp32 over gloo: bitwise), staged and loaded from there; the run ends at the reference's
    parameters. Under `colocated` every device trains and generates, so each step publishes to both nodes (digen's
    search, on costs profiled under the suite's load, may keep its trainer and so its publications on one node)."""
    config = on_cluster(cluster, FLOW, "colocated", publication="collective")
    summary = train(parse_config(config), tmp_path, steps=STEPS)
    assert len(set(worker_nodes()[:2])) == 2, "the run's two devices are on two nodes"
    (publication,) = summary["publication"].values()
    assert publication["setting"] == publication["path"] == "collective"
    # each step's publication reached the other node's device by broadcast; the sender's own rollout engine loads
    # from its node's object store (shared memory)
    assert publication["loads"] == {"collective": STEPS, "object_store": STEPS}
    assert same_parameters("digits", alone["digits"], final_weights(tmp_path))
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []
    # the run over, its publication groups' rendezvous keys are gone from Ray's store (this run's and the earlier
    # runs' of the module, whose `auto` formed groups across the nodes too)
    assert internal_kv._internal_kv_list(b"publication-", namespace=NAMESPACE) == []


def test_auto_times_both_publication_paths_across_nodes_and_keeps_the_faster(cluster, alone, tmp_path, capsys):
    summary = train(parse_config(on_cluster(cluster, FLOW, "digen")), tmp_path, steps=STEPS)
    (publication,) = summary["publication"].values()
    seconds = {"object_store": publication["object_store_s"], "collective": publication["collective_s"]}
    assert publication["setting"] == "auto" and 0 < min(seconds.values())
    assert publication["path"] == min(seconds, key=seconds.__getitem__)
    assert publication == json.loads((tmp_path / "run_profile.json").read_text())["publication"]["digits"]
    said = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines() if "publication auto" in line]
    assert len(said) == 1 and said[0].startswith(f"publication auto: {publication['path'].replace('_', ' ')}")
    assert same_parameters("digits", alone["digits"], final_weights(tmp_path))


def test_the_pool_keeps_each_nodes_devices_together():
    """PACK may interleave a group's bundles over nodes; the run's device indices keep each node's together, so that
    a policy's ranges of devices (a trainer group, a rollout pool) are node-local where they fit."""
    bundles = [("a", 0), ("b", 1), ("a", 2), ("c", 3), ("b", 4)]
    assert by_node(bundles, lambda b: b[0]) == [("a", 0), ("a", 2), ("b", 1), ("b", 4), ("c", 3)]


def remove_node_of_device(cluster, device: int) -> str:
    """Remove the node that holds `device` of the job's pool, at once, as a lost machine: its raylet and the worker
    processes it started (which would otherwise go on for a moment, long enough to finish a step by broadcast)."""
    node_id = worker_nodes()[device]
    (node,) = [node for node in cluster.worker_nodes if node.node_id == node_id]
    (raylet,) = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]
    workers = psutil.Process(raylet.process.pid).children(recursive=True)
    cluster.remove_node(node, allow_graceful=False)
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()
    return node_id


def test_a_lost_node_comes_back_on_a_spare_node_and_the_run_ends_at_the_reference(cluster, alone, tmp_path):
    """A flow run under digen spread over two nodes; device 0's node goes after step 1's commit: its worker restarts
    on the spare node and the group forms again without it (the rendezvous is in Ray's key-value store, not on any
    device)."""
    removed = []

    def lose_device_zero(executor, part):
        if not removed and executor.committed_steps("digits") == 1:
            assert len(set(worker_nodes()[:2])) == 2, "the run's two devices are on two nodes"
            removed.append(remove_node_of_device(cluster, 0))

    summary = train(
        parse_config(on_cluster(cluster, FLOW, "digen")), tmp_path, steps=STEPS, after_part=lose_device_zero
    )
    assert removed and removed[0] not in worker_nodes()[:2] and summary["restarts"] >= 1
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []
    assert same_parameters("digits", alone["digits"], final_weights(tmp_path))


def test_without_a_spare_node_the_run_goes_on_on_the_devices_left(cluster, alone, tmp_path, capsys):
    """No spare node is left (the test above took it): a lost node's device has no node to come back on, and after
    cluster.lost_after_s the run goes on from its last committed step on the one device left, says so in one line,
    and ends at the reference's parameters with a clean ledger."""
    removed: list[float] = []
    resumed: list[float] = []

    def lose_device_one(executor, part):
        if not removed and executor.committed_steps("digits") == 1:
            remove_node_of_device(cluster, 1)
            removed.append(time.monotonic())
        elif removed and not resumed and executor.setup.devices == 1:
            resumed.append(time.monotonic())

    config = parse_config(on_cluster(cluster, FLOW, "digen", lost_after_s=LOST_AFTER_S))
    summary = train(config, tmp_path, steps=STEPS, after_part=lose_device_one)
    assert summary["devices_lost"] == 1
    # Ray's detection of the node's death, the grace period, then the survivor configured for the step again from its
    # last commit: seconds (about 14 here), where a device waited for would have taken the recovery deadline
    assert LOST_AFTER_S <= resumed[0] - removed[0] <= DETECTION_S + LOST_AFTER_S + 20, resumed[0] - removed[0]
    said = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines() if "lost device" in line]
    assert said == [
        f"lost device 1 (no node for {LOST_AFTER_S:g} s): going on from step 1 on the 1 device left under digen"
    ]
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["problems"] == []
    assert {row["step"] for row in ledger["trained"]} == set(range(STEPS))
    assert ledger["went_on"] == [{"step": 1, "devices": 1, "why": f"lost device 1 (no node for {LOST_AFTER_S:g} s)"}]
    assert same_parameters("digits", alone["digits"], final_weights(tmp_path))
    # the trace is of the whole run: step 0 on both devices, the steps after the loss on device 0 alone (step 1 ran
    # in part on both before it), a mark where the run went on; the profile replays the last stretch and names the first
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and "step" in e["args"]]  # role switches belong to no step
    devices_of = {step: {e["tid"] for e in spans if e["args"]["step"] == step} for step in range(STEPS)}
    assert devices_of[0] == {0, 1} and all(devices_of[step] == {0} for step in range(2, STEPS))
    assert [e["name"] for e in events if e["ph"] == "i"] == said
    profile = json.loads((tmp_path / "run_profile.json").read_text())
    assert profile["segments_before"] == [{"first_step": 0, "steps": 1, "devices": [0, 1], "why": "began on 2 devices"}]
    assert profile["config"]["cluster"]["devices"] == 1


def digen_on_two_devices_again(cluster, tmp_path, after_part) -> dict:
    """A flow run under digen on two device nodes, `after_part` its fault; the tests before it left one device node:
    a node joins first."""
    cluster.add_node(num_cpus=0, resources={DEVICE_RESOURCE: 1}, node_ip_address=LOOPBACK)
    config = parse_config(on_cluster(cluster, FLOW, "digen", lost_after_s=LOST_AFTER_S))
    return train(config, tmp_path, steps=STEPS, after_part=after_part)


def test_a_node_lost_after_the_last_step_leaves_the_run_complete(cluster, alone, tmp_path, capsys):
    """Device 1's node goes once the last step is committed (its publication still to come): every step is saved, so
    the run ends there, says so in one line and writes its trace, ledger and summary, without waiting for a device
    it no longer needs. The tests above left one device node: a node joins first."""

    def lose_device_one_at_the_end(executor, part):
        if executor.committed_steps("digits") == STEPS and not lost:
            lost.append(remove_node_of_device(cluster, 1))

    lost: list[str] = []
    summary = digen_on_two_devices_again(cluster, tmp_path, lose_device_one_at_the_end)
    assert lost and summary["devices_lost"] == 1 and summary["device_engines"] is None
    said = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines() if "lost device" in line]
    assert said == [f"lost device 1 (no node for {LOST_AFTER_S:g} s) after the last step; the run is complete"]
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []
    assert same_parameters("digits", alone["digits"], final_weights(tmp_path))


def test_a_lost_node_with_the_other_replicas_process_goes_on_from_the_copy_on_its_node(cluster, alone, tmp_path):
    """The node that holds the committed state goes, and the other trainer replica's worker process dies with it (as
    a torch.distributed peer of a dead process may): the driver's node holds a copy of the state, so the run goes on
    from step 1 on the other replica's restarted worker and ends at the reference's parameters."""

    def lose_both(executor, part):
        if executor.committed_steps("digits") == 1 and not lost:
            state = executor.pipelines["digits"].trainer_state
            devices = worker_nodes()
            # the replica's node that holds it (the driver's, the head, holds a copy)
            (holder,) = set(ray.experimental.get_object_locations([state])[state]["node_ids"]) & set(devices)
            device = devices.index(holder)
            lost.append(remove_node_of_device(cluster, device))
            psutil.Process(executor.pipelines["digits"].incarnations.pids[1 - device]).kill()

    lost: list[str] = []
    summary = digen_on_two_devices_again(cluster, tmp_path, lose_both)
    assert lost and summary["devices_lost"] == 1
    (went_on,) = json.loads((tmp_path / "ledger.json").read_text())["went_on"]
    assert went_on["step"] == 1 and went_on["devices"] == 1
    assert same_parameters("digits", alone["digits"], final_weights(tmp_path))
