"""The one event loop both executors run at each instant: take the events, let the policy react, apply its
decisions; again, until nothing changes. The simulator then advances its clock to the next predicted completion,
the Ray runtime waits for the next actor call to return."""

from collections.abc import Callable, Sequence

from dovetail.plan.state import ClusterState
from dovetail.sched.policy import Decision, Event, Policy

MAX_ROUNDS_AT_ONE_TIME = 100_000


def settle(
    state: ClusterState,
    policy: Policy,
    carry_out: Callable[[Decision], None],
    on_events: Callable[[Sequence[Event]], None] | None = None,
) -> None:
    """React until the policy has nothing more to decide at `state.now`. `carry_out` is the executor's part of
    each applied decision (time it, or launch it); `on_events` sees every batch of events first (the runtime logs
    commits there). A policy that keeps deciding without time passing is a bug: it raises instead of spinning."""
    for _ in range(MAX_ROUNDS_AT_ONE_TIME):
        events = state.take_events()
        if on_events is not None and events:
            on_events(events)
        decisions = policy.react(state, events)
        if not events and not decisions:
            return
        for decision in decisions:
            state.apply(decision)
            carry_out(decision)
    raise RuntimeError(f"policy {policy.name} keeps deciding at t={state.now:.3f}s without time passing")
