"""SimExecutor: a discrete-event simulation of a cluster running a policy over a sub-stage graph.

Durations are the nodes' predicted costs (from the cost model), an environment's wait its drawn seconds on no
device; nodes sharing a device run at the speed the interference model gives them (`ClusterState`), re-timed whenever
a neighbour comes or goes, and optionally stretched by log-normal noise; the same seed gives the same trace. The hot
loop is a heap of completion times."""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from dovetail.graph.node import Graph
from dovetail.plan.loop import settle
from dovetail.plan.state import ClusterState
from dovetail.plan.trace import Trace
from dovetail.sched.policy import Migrate, Policy, Run, Setup, SwitchRole


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a simulation runs or a search builds and simulates its cuts
    (`plan.prepare.prepare`), as it was after. They allocate hundreds of thousands of objects (nodes, spans,
    decisions, events), each batch of them triggering a collection, and the older generations' collections walk every
    object alive: in a search or a plan, every candidate's graph and trace kept so far. That was a sixth of a plan's
    time on 8-256 devices. They make no reference cycle that must be freed before they end (a plan's peak memory is
    the same with the collector on); whatever cycles they leave are collected after, by the collections later
    allocations trigger."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GaveUp(Exception):
    """A run stopped by its `give_up` (`SimExecutor.run`); its argument: the end of the latest span then."""


class SimExecutor:
    def __init__(
        self,
        graph: Graph,
        setup: Setup,
        *,
        seed: int = 0,
        noise: float = 0.0,
        slowdown: Callable[[str, str], float] | None = None,
        device_pace: Sequence[float] | None = None,
    ) -> None:
        """`slowdown(kind, alongside_kind)`: the interference model of nodes sharing a device (e.g.
        `Calibration.slowdown`); None means a shareable node runs at its share. `device_pace[d]` stretches the
        work of device d (a straggler: the replay of a real run fits one per device); a node on several devices
        goes at its slowest one's pace."""
        if noise < 0:
            raise ValueError(f"noise must be >= 0 (log-normal sigma of durations), got {noise}")
        if device_pace is not None and (len(device_pace) != setup.devices or min(device_pace) <= 0):
            raise ValueError(
                f"device_pace needs one positive factor per device ({setup.devices}), got {list(device_pace)}"
            )
        self.device_pace = device_pace
        self.graph = graph
        self.setup = setup
        self.seed = seed
        self.noise = noise
        self.slowdown = slowdown

    def run(self, policy: Policy, give_up: Callable[[float], bool] | None = None) -> Trace:
        """`_run` with the cyclic garbage collector paused (`collector_paused`)."""
        with collector_paused():
            return self._run(policy, give_up)

    def _run(self, policy: Policy, give_up: Callable[[float], bool] | None) -> Trace:
        """The trace of the policy running the graph to its end. `give_up`, asked after each instant with the end of
        the latest span recorded (a lower bound of the run's makespan, `Trace.makespan`), stops the run by raising
        `GaveUp` once it says so: a search that only asks whether a candidate beats a figure stops simulating one
        that cannot."""
        state = ClusterState(self.graph, self.setup, self.slowdown)
        spans = state.trace.spans
        rng = random.Random(self.seed)
        heap: list[tuple[float, int, str, SwitchRole | str]] = []  # (time, counter, "switch" | "node", payload)
        segment: dict[str, int] = {}
        counter = 0
        state.begin()

        def carry_out(decision) -> None:
            nonlocal counter
            counter += 1
            if isinstance(decision, (Run, Migrate)) and (self.noise or self.device_pace):
                pace = max(self.device_pace[d] for d in decision.devices) if self.device_pace else 1.0
                if self.noise:
                    pace *= math.exp(rng.gauss(0.0, self.noise))
                state.set_pace(decision.node, pace)
            elif isinstance(decision, SwitchRole):
                heapq.heappush(heap, (state.now + decision.cost_s, counter, "switch", decision))

        while True:
            settle(state, policy, carry_out)
            for node_id in state.take_retimed():
                counter += 1
                segment[node_id] = counter
                heapq.heappush(heap, (state.now + state.remaining(node_id), counter, "node", node_id))
            for node_id, seconds in state.take_waits():
                counter += 1
                heapq.heappush(heap, (state.now + seconds, counter, "wait", node_id))
            if not heap:
                if state.done:
                    return state.trace
                raise RuntimeError(f"policy {policy.name} stalled: {state.stuck_message()}")
            time, _, _, _ = heap[0]
            state.now = time
            while heap and heap[0][0] == time:
                _, number, what, payload = heapq.heappop(heap)
                if isinstance(payload, SwitchRole):  # a "switch" entry; a "node" or "wait" entry holds the node id
                    state.finish_switch(payload.device, payload.role, payload.resident_gb)
                elif what == "wait":
                    state.finish_wait(payload)
                elif segment.get(payload) == number:
                    del segment[payload]
                    state.finish_node(payload)
            if give_up is not None and spans and give_up(spans[-1].end):
                raise GaveUp(spans[-1].end)
