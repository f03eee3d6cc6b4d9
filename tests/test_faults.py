"""Fault injection (tests/fault_injection.py): DeviceWorker processes SIGKILLed at named moments of a digen run —
during the start-up profile, every trainer replica between a commit and its publish, every worker at once. Every run
recovers within the deadline, loses no sample, trains none twice, and ends bitwise equal to an undisturbed run
(the commit adds the train parts' gradients in fp64, whose sum is the same bits wherever they ran).

Four cells of the 18-cell kill matrix run here, the four that exercise distinct recovery paths (a profile
re-measured, an open step's gradients rebuilt, a committed state brought back from the object store, a whole group
re-formed); the whole matrix is benchmarks/kill_matrix.py (about 20 minutes)."""

import json
import os
import time
import uuid

import numpy as np
import pytest
import ray
import torch
from fault_injection import CONFIG, Fault
from running import train
from safetensors.torch import load_file

from dovetail.config.load import load_config
from dovetail.graph.node import Kind
from dovetail.rewards import RewardError
from dovetail.runtime.launch import device_pool
from dovetail.runtime.rendezvous import abandon
from dovetail.runtime.worker import GROUP_TIMEOUT_S, form_group

STEPS = 3
pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]


def weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    out = tmp_path_factory.mktemp("undisturbed")
    train(load_config(None, CONFIG), out, steps=STEPS)
    return weights(out)


@pytest.mark.parametrize(
    ("moment", "spread"),
    [
        ("start-up", "one"),
        ("train", "one"),  # the device held gradients of the open step: they are rebuilt, not lost
        ("commit", "two close"),  # every trainer replica dead by the publish: one is brought back to publish from
        ("generate", "all"),
    ],
)
def test_killed_workers_recover_and_the_run_is_bitwise_the_undisturbed_one(
    moment, spread, undisturbed, tmp_path, monkeypatch
):
    if moment == "start-up":  # the kill lands in the start-up profile: measure it, do not read it from the cache
        monkeypatch.setenv("DOVETAIL_CACHE", "off")
    fault = Fault(moment, spread, STEPS)
    summary = train(load_config(None, CONFIG), tmp_path, steps=STEPS, **fault.hooks())
    assert fault.killed and summary["restarts"] >= 1, (fault.killed, summary["restarts"])
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["problems"] == []
    if moment == "train":
        assert ledger["restarts"] and ledger["reruns"], "the killed device's train parts ran again"
    got = weights(tmp_path)
    assert all(torch.equal(got[k], undisturbed[k]) for k in undisturbed)


@pytest.mark.parametrize(("moment", "spread"), [("train", "one"), ("commit", "two close")])
def test_a_run_of_two_updates_a_batch_recovers_to_the_reference_loops_bits(moment, spread, tmp_path):
    """algo.num_iterations=2 under verl-sync: a device killed holding train parts of the open step rebuilds them,
    and they train again at the commit's second update; every trainer replica dead after the commit comes back with
    the state both updates left. The run ends at the reference loop's bits."""
    config = [
        "kind=lm", "task=sort", "algo.prompts_per_step=4", "algo.group_size=4", "algo.micro_batches=1",
        "eval.every=100", "checkpoint.every=100", "runtime.profile_samples=4", "train.lr=1e-3",
        "algo.num_iterations=2", "cluster.devices=2",
    ]  # fmt: skip
    train(load_config(None, [*config, "policy=reference"]), tmp_path / "reference", steps=STEPS)
    fault = Fault(moment, spread, STEPS)
    summary = train(load_config(None, [*config, "policy=verl-sync"]), tmp_path / "ray", steps=STEPS, **fault.hooks())
    assert fault.killed and summary["restarts"] >= 1, (fault.killed, summary["restarts"])
    assert json.loads((tmp_path / "ray" / "ledger.json").read_text())["problems"] == []
    expected, got = weights(tmp_path / "reference"), weights(tmp_path / "ray")
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_run_stopped_after_its_first_step_resumes_bitwise_to_the_undisturbed_one(local_ray, undisturbed, tmp_path):
    """The driver's side of a fault: the run stops after step 1's commit (its reward fails: the driver saves the last
    committed step and exits, as after a crash past a checkpoint) and `--resume` trains steps 2 and 3 to the same bits
    as the run that never stopped (the reward is digit_match's values while unflagged). A damaged ledger.json left in
    the run directory changes nothing: a run writes its own ledger, it never reads one."""
    flag = local_ray
    config = load_config(None, [*CONFIG, "reward={faulty_reward:nan_when_flagged: 1.0}"])

    def break_reward_after_first_commit(executor, part):
        if part.node.endswith("s0/commit0"):
            flag.touch()

    with pytest.raises(RewardError):
        train(config, tmp_path, steps=STEPS, after_part=break_reward_after_first_commit)
    flag.unlink()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    (tmp_path / "ledger.json").write_bytes(os.urandom(512))
    train(config, tmp_path, steps=STEPS, resume=tmp_path)
    got = weights(tmp_path)
    assert all(torch.equal(got[k], undisturbed[k]) for k in undisturbed)
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []


def test_the_committed_state_is_the_recorded_steps_while_a_commit_is_half_done(tmp_path):
    """Between the first and the last trainer replica finishing a commit, the newest state runs a step ahead of the
    recorded ones; what the driver reads as committed (a run that goes on without a lost device starts from it)
    stays the recorded steps' state: the checkpoint written when the last step was recorded."""
    half_done: dict[int, dict[str, np.ndarray]] = {}

    def read_mid_commit(executor, part):
        node = executor.graph[part.node]
        if node.kind == Kind.COMMIT and part.node not in executor.state.finished:
            half_done[executor.committed_steps("digits")] = executor.committed_state("digits")["weights"]

    train(load_config(None, [*CONFIG, "checkpoint.every=1"]), tmp_path, steps=STEPS, after_part=read_mid_commit)
    assert sorted(half_done) == list(range(STEPS))
    for step in range(1, STEPS):
        recorded = load_file(tmp_path / "checkpoints" / f"step_{step:06d}" / "model.safetensors")
        assert all(np.array_equal(half_done[step][k], recorded[k].numpy()) for k in recorded), step


def test_a_worker_waiting_for_a_dead_peer_answers_pings_and_stops_waiting_once_its_group_is_abandoned():
    """What lets a revive go on while a survivor's commit waits at a rendezvous for a member that died: the
    survivor's ping answers on a thread of its own, and once the driver marks the group abandoned the wait ends in
    an error (its part is sent again into the next group), not after the store's 120 s timeout; the next group then
    forms, this worker's first forming having failed."""
    workers = device_pool(load_config(None, CONFIG)).workers(0)
    worker = workers[0]
    prefix = f"test-{uuid.uuid4().hex}"
    waiting = worker.join_group.remote(prefix, 0, 2)  # rank 1 never comes
    assert ray.wait([waiting], timeout=1.0)[0] == []
    assert ray.get(worker.ping.remote(), timeout=5) > 0
    abandoned_at = time.monotonic()
    abandon(prefix)
    with pytest.raises(ray.exceptions.RayTaskError, match="a member died"):
        ray.get(waiting, timeout=30)
    assert time.monotonic() - abandoned_at < GROUP_TIMEOUT_S / 4  # at the abandon, not the group's timeout
    form_group(workers)  # and the next group forms with it (a failed forming left torch's group names apart once)
