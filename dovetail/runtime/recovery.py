"""Bringing a pipeline's DeviceWorkers back after some of them died, within a deadline — or telling the run which
devices are lost.

Ray restarts a dead actor (`max_restarts=-1`), but the new process is bare: it holds no engines and is in no
torch.distributed group. `revive` waits until every worker of the pipeline answers, gives each new incarnation the
pipeline's config and last committed trainer state, and forms the pipeline's group again — whenever a worker died:
during the start-up profile, in the middle of a step, two close together, all at once, after the last step. A
worker whose device is still there (its process died; or its node did and a spare node took its place) may take
`RECOVERY_DEADLINE_S` to come back, then it is one clear error, never a hang. A device whose node is gone with no
node to take its place (its placement group bundle unplaced) for `lost_after_s` is lost: `StepLost` lets the run
go on without it (`runtime.driver`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError

from dovetail.runtime.rendezvous import abandon, forget
from dovetail.runtime.worker import form_group

RECOVERY_DEADLINE_S = 180.0
"""Seconds a pipeline's workers may take to come back on their devices (a restart loads torch and the engines)."""
POLL_S = 0.2
ANSWER_POLL_S = 1.0
"""How often a wait for workers' answers looks for lost devices."""


class StepLost(RuntimeError):
    """The open step cannot finish: a node went and took with it what the step had made there (rollouts, scores,
    published weights in its object store), or devices that had no node for the grace period (`devices`). The run
    goes on from its last committed step, on the devices that remain (`runtime.driver`)."""

    def __init__(self, why: str, devices: list[int] | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.devices = devices or []


def devices_lost(devices: list[int], lost_after_s: float) -> StepLost:
    plural = "s" if len(devices) > 1 else ""
    return StepLost(f"lost device{plural} {', '.join(map(str, devices))} (no node for {lost_after_s:g} s)", devices)


@dataclass
class LostWatch:
    """Which devices have had no node (`unplaced()`) for `lost_after_s`, looked at by a wait for answers."""

    unplaced: Callable[[], list[int]]
    lost_after_s: float
    since: dict[int, float] = field(default_factory=dict)

    def check(self) -> None:
        now = time.monotonic()
        self.since = {device: self.since.get(device, now) for device in self.unplaced()}
        lost = sorted(device for device, since in self.since.items() if now - since >= self.lost_after_s)
        if lost:
            raise devices_lost(lost, self.lost_after_s)


def never_unplaced() -> list[int]:
    """A pool whose devices cannot lose their node (a test's workers outside placement groups)."""
    return []


class RecoveryTimeout(RuntimeError):
    """A worker did not come back within the recovery deadline."""


@dataclass
class Incarnations:
    """What the driver knows of a pipeline's worker processes: the process each runs in now (a new one is a restart)
    and the rendezvous prefix of the group they formed last. The start-up and each executor share one."""

    pids: list[int]
    group: str | None = None
    publishing: dict[tuple[int, ...], str] = field(default_factory=dict)
    """The rendezvous prefix of each publication group (`runtime.publication`: sender first, then receivers) formed."""
    publications: str = field(default_factory=lambda: f"publication-{uuid.uuid4().hex}")
    """What every publication group of the run meets under (`publication_prefix`), so that all of them, abandoned
    or not, are forgotten at once when the run is over (`forget_publications`)."""

    def seen(self, device: int, pid: int | None) -> None:
        """A ping of `device` answered `pid` (None: its process had died). A death abandons the group and the
        publication groups, so that their survivors stop waiting for the dead member at a rendezvous and answer too
        (`rendezvous.abandon`)."""
        if pid != self.pids[device]:
            if self.group is not None:
                abandon(self.group)
                self.group = None
            self.drop_publishing()

    def publication_prefix(self, group: tuple[int, ...]) -> str:
        """The rendezvous prefix of the publication group `group` (sender first): a new one the first time, until the
        groups are dropped."""
        if group not in self.publishing:
            self.publishing[group] = f"{self.publications}/{uuid.uuid4().hex}"
        return self.publishing[group]

    def forget_publications(self) -> None:
        """Delete the rendezvous keys of every publication group the run formed, once the run is over and its last
        publication loaded (each worker drops its groups at its next `configure`). Not where the run goes on without
        a lost device: a survivor may still wait at an abandoned group's rendezvous for its abandoned mark."""
        forget(self.publications)
        self.publishing.clear()

    def drop_publishing(self) -> None:
        """Abandon every publication group: the next publication forms its group anew."""
        for prefix in self.publishing.values():
            abandon(prefix)
        self.publishing.clear()


def revive(
    workers: list,
    incarnations: Incarnations,
    config: dict,
    trainer_state: Callable[[], ray.ObjectRef],
    deadline_s: float,
    lost: LostWatch,
) -> list[int]:
    """Wait for every worker to answer; configure the ones that are new incarnations (their pid changed) with `config`
    (a config dump) and the ref `trainer_state()` gives, asked only where a worker restarted (a sharded trainer's is
    joined from its members' shards for it), and form the group again if any was (`incarnations` is updated).
    Returns the devices that restarted; raises `StepLost` for devices `lost` finds gone."""
    state: ray.ObjectRef | None = None
    end = time.monotonic() + deadline_s
    while True:
        current = _answers(workers, incarnations, end, lost)
        restarted = [device for device, (old, new) in enumerate(zip(incarnations.pids, current)) if old != new]
        if not restarted:
            return []
        state = state if state is not None else trainer_state()
        try:
            ray.get([workers[device].configure.remote(config, state, device) for device in restarted])
            incarnations.group = form_group(workers)
        except RayActorError:  # another worker died meanwhile: start over, it is a new incarnation too
            _check(end, workers)
            time.sleep(POLL_S)
            continue
        incarnations.pids[:] = current
        return restarted


def _answers(workers: list, incarnations: Incarnations, end: float, lost: LostWatch) -> list[int]:
    """Every worker's pid, once all of them answer. A worker that has not answered within ANSWER_POLL_S is asked
    again: a ping sent as its process died may never be answered (a busy worker answers at once: `ping`). Each
    answer is shown to `incarnations`, which abandons the group at the first sign of a death."""
    pings = [worker.ping.remote() for worker in workers]
    while True:
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=ANSWER_POLL_S)
        answers = [_answer(ping) if ping in ready else None for ping in pings]
        for device, ping in enumerate(pings):
            if ping in ready:
                incarnations.seen(device, answers[device])
        if all(answer is not None for answer in answers):
            return [answer for answer in answers if answer is not None]
        # asked again: who had not answered, and who had died (its next incarnation answers)
        pings = [
            ping if answer is not None else worker.ping.remote()
            for ping, answer, worker in zip(pings, answers, workers)
        ]
        lost.check()
        _check(end, workers)
        if len(ready) == len(pings):
            time.sleep(POLL_S)


def _answer(ping) -> int | None:
    """The pid a ready ping answered; None if the worker died before it answered."""
    try:
        return ray.get(ping)
    except RayActorError:
        return None


def _check(end: float, workers: list) -> None:
    if time.monotonic() > end:
        raise RecoveryTimeout(
            f"a worker of {len(workers)} did not come back within the recovery deadline; check the devices "
            "(`ray status`) and resume with --resume RUN_DIR"
        )


@dataclass
class Started:
    """A pipeline's workers, configured for the run, and its initial weights and trainer state in the object store."""

    config: dict
    """The pipeline's config dump, as its workers were configured (and a restarted one is again)."""
    workers: list
    incarnations: Incarnations
    """The process of each worker now (a new one is a restart: `recovery.revive`) and their group."""
    weights: ray.ObjectRef
    trainer_state: ray.ObjectRef
    lost: Callable[[], LostWatch]
    """A new watch for lost devices of the pool the workers are in."""
    restarts: list[tuple[float, int, str]] = field(default_factory=list)
    """Devices that restarted before the run's first step (during the start-up profile), as the ledger keeps them."""

    def revive(self, during: str) -> None:
        watch = self.lost()
        for index in revive(
            self.workers, self.incarnations, self.config, lambda: self.trainer_state, RECOVERY_DEADLINE_S, watch
        ):
            self.restarts.append((0.0, index, during))
