"""Fault injection for the Ray runtime: SIGKILL DeviceWorker processes by PID at named moments of a run.

A `Fault` names the moment and which devices die; `Fault.hooks()` gives `train` its `after_start` / `after_part`
hooks. Moments:
  start-up   while the workers profile (a timer fires shortly after they are configured)
  generate   right after a rollout part of step 1 returned
  train      right after a train part of step 1 returned (the device holds gradients of the open step)
  commit     right after the first commit part of step 1 returned (the other device may be mid-all-reduce)
  publish    right after a weights load of step 1 returned
  last step  right after the run's last publish returned (before the run directory is written)
`devices`: one device, two close together (the second at the next part after the first), or every device at once.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field

import ray

from dovetail.pipelines.flow.messages import FlowTrain, Generate
from dovetail.pipelines.lm.messages import LMTrain, Prefill
from dovetail.runtime.messages import Commit, LoadWeights

CONFIG = [
    "eval.every=100",
    "checkpoint.every=100",
    "cluster.devices=2",
    "policy=digen",
    "runtime.fragments=4",
    "runtime.tsp_chunk=5",
    "runtime.trainer_group=1",  # each device trains whole train nodes: bitwise repeatable whatever else is searched
]
"""The run the faults are injected into (tests and benchmarks/kill_matrix.py): digen on 2 devices."""
MOMENTS = ("start-up", "generate", "train", "commit", "publish", "last step")
SPREADS = ("one", "two close", "all")
START_UP_DELAY_S = 0.5
"""The start-up profile takes seconds: a kill this long after the workers are configured lands inside it."""
CLOSE_S = 0.3
"""Seconds between the two kills of "two close" at start-up (at other moments: the next part that returns)."""


def kill(worker) -> int:
    """SIGKILL the worker's process (Ray restarts the actor); returns its pid."""
    pid = ray.get(worker.ping.remote())
    os.kill(pid, signal.SIGKILL)
    return pid


@dataclass
class Fault:
    moment: str
    spread: str = "one"
    steps: int = 3
    killed: list[tuple[str, int]] = field(default_factory=list)
    """(moment or "next part", device) of every kill made."""

    def hooks(self) -> dict:
        return {"after_start": self._after_start, "after_part": self._after_part}

    def _victims(self, workers: list, device: int) -> list[tuple[int, object]]:
        if self.spread == "all":
            return list(enumerate(workers))
        return [(device, workers[device])]

    def _strike(self, workers: list, device: int, label: str) -> None:
        for index, worker in self._victims(workers, device):
            kill(worker)
            self.killed.append((label, index))

    def _after_start(self, started: dict) -> None:
        if self.moment != "start-up":
            return
        workers = next(iter(started.values())).workers
        threading.Timer(START_UP_DELAY_S, self._strike, (workers, 0, self.moment)).start()
        if self.spread == "two close":
            threading.Timer(START_UP_DELAY_S + CLOSE_S, self._strike, (workers, 1, "next part")).start()

    def _after_part(self, executor, part) -> None:
        run = executor.run_of(part.node)
        if self.killed and self.spread == "two close" and len(self.killed) == 1 and self.moment != "start-up":
            other = 1 - self.killed[0][1]
            self._strike(run.workers, other, "next part")
            return
        if self.killed and self.moment != "start-up":
            return
        if self._is_moment(executor, part):
            self._strike(run.workers, part.device, self.moment)

    def _is_moment(self, executor, part) -> bool:
        work, step = part.work, executor.graph[part.node].step
        if self.moment == "last step":
            return isinstance(work, LoadWeights) and step == self.steps - 1
        if step != 1:
            return False
        kinds = {
            "generate": (Generate, Prefill),
            "train": (FlowTrain, LMTrain),
            "commit": (Commit,),
            "publish": (LoadWeights,),
        }
        return isinstance(work, kinds.get(self.moment, ()))
