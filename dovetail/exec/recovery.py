"""Bringing a pipeline's DeviceWorkers back after some of them died, within a deadline.

Ray restarts a dead actor (`max_restarts=-1`), but the new process is bare: it holds no engines and is in no
torch.distributed group. `revive` waits until every worker of the pipeline answers, gives each new incarnation the
pipeline's config and last committed trainer state, and forms the pipeline's group again — whenever a worker died:
during the start-up profile, in the middle of a step, two close together, all at once, after the last step. A
worker that does not come back within the deadline is one clear error, never a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dovetail.exec.worker import form_group

RECOVERY_DEADLINE_S = 180.0
"""Seconds a pipeline's workers may take to come back (a restart loads torch and the engines again)."""
POLL_S = 0.2


class RecoveryTimeout(RuntimeError):
    """A worker did not come back within the recovery deadline."""


def revive(workers: list, pids: list[int], config: dict, trainer_state, deadline_s: float) -> list[int]:
    """Wait for every worker to answer; configure the ones that are new incarnations (their pid changed, `pids` is
    updated) with `config` (a config dump) and `trainer_state` (a ref), and form the group again if any was.
    Returns the devices that restarted."""
    end = time.monotonic() + deadline_s
    while True:
        current = _answers(workers, end)
        restarted = [device for device, (old, new) in enumerate(zip(pids, current)) if old != new]
        if not restarted:
            return []
        try:
            ray.get([workers[device].configure.remote(config, trainer_state) for device in restarted])
            form_group(workers)
        except RayActorError:  # another worker died meanwhile: start over, it is a new incarnation too
            _check(end, workers)
            time.sleep(POLL_S)
            continue
        pids[:] = current
        return restarted


def _answers(workers: list, end: float) -> list[int]:
    """Every worker's pid, once all of them answer."""
    while True:
        try:
            return ray.get([worker.ping.remote() for worker in workers], timeout=max(POLL_S, end - time.monotonic()))
        except (RayActorError, GetTimeoutError):
            _check(end, workers)
            time.sleep(POLL_S)


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
    pids: list[int]
    """The process of each worker now: a new one is a restart (`recovery.revive`)."""
    weights: ray.ObjectRef
    trainer_state: ray.ObjectRef
    restarts: list[tuple[float, int, str]] = field(default_factory=list)
    """Devices that restarted before the run's first step (during the start-up profile), as the ledger keeps them."""

    def revive(self, during: str) -> None:
        for index in revive(self.workers, self.pids, self.config, self.trainer_state, RECOVERY_DEADLINE_S):
            self.restarts.append((0.0, index, during))
