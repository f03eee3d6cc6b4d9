"""Compare policies on a scenario and show what their searches chose from: what `dovetail simulate` and
`dovetail plan` print."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dovetail.cost.model import CostModel
from dovetail.plan.metrics import summarize
from dovetail.plan.prepare import Searched, prepare, run_prepared, searched_from, simulate
from dovetail.plan.scenario import Scenario
from dovetail.plan.sim import collector_paused
from dovetail.sched import POLICIES, policy_class
from dovetail.sched.policy import Shape, search_horizon


def _per_policy(path: Path | None, policy: str, several: bool) -> Path | None:
    if path is None or not several:
        return path
    return path.with_name(f"{path.stem}.{policy}{path.suffix}")


def compare(
    scenario: Scenario,
    policies: list[str] | None = None,
    *,
    steps: int | None = None,
    trace: Path | None = None,
    gantt: Path | None = None,
) -> dict:
    """Simulate every policy; the JSON object `dovetail simulate --json` prints. Speedups are over the first policy
    that runs. A policy that cannot run the scenario (memory, too few devices, a field it cannot honour) gets
    {"error": its one-line reason} in place of numbers; an unknown policy name is bad input (ValueError)."""
    names = policies or scenario.schedule.policies
    for name in names:
        policy_class(name)
    result: dict = {"scenario": scenario.name, "devices": scenario.cluster.devices, "policies": {}}
    baseline = None
    cost = CostModel(scenario.cluster.catalogue_device())  # one for every policy, as `plan` shares it
    for name in names:
        try:
            _, run = simulate(scenario, name, steps=steps, cost=cost)
        except ValueError as error:
            result["policies"][name] = {"error": str(error)}
            continue
        metrics = summarize(run)
        baseline = baseline or metrics.samples_per_s
        if path := _per_policy(trace, name, len(names) > 1):
            run.write_chrome(path)
        if path := _per_policy(gantt, name, len(names) > 1):
            run.write_gantt(path, f"{scenario.name}: {name}")
        result["policies"][name] = {
            "samples_per_s": metrics.samples_per_s,
            "tokens_per_s": metrics.tokens_per_s,
            "step_time_s": metrics.step_time_s,
            "steady_step_s": metrics.steady_step_s,
            "first_step_s": metrics.first_step_s,
            "speedup": metrics.samples_per_s / baseline,
            "efficiency": metrics.efficiency,
            "bubble_ratio": metrics.bubble_ratio,
            "max_staleness": metrics.max_staleness,
            "peak_memory_gb": metrics.peak_memory_gb,
            "step_latency_s": metrics.step_latency_s,
            "phase_seconds": metrics.phase_seconds,
        }
    return result


def render_table(result: dict) -> str:
    header = (
        f"{'policy':16s} {'samples/s':>10s} {'step s':>9s} {'steady s':>9s} {'speedup':>8s} {'effic.':>7s} "
        f"{'bubble':>7s} {'stale':>6s} {'peak GB':>8s}"
    )
    lines = [f"{result['scenario']} ({result['devices']} devices)", header, "-" * len(header)]
    for name, m in result["policies"].items():
        if "error" in m:
            lines.append(f"{name:16s} cannot run: {' '.join(m['error'].split())}")
            continue
        lines.append(
            f"{name:16s} {m['samples_per_s']:10.3f} {m['step_time_s']:9.1f} {m['steady_step_s']:9.1f} "
            f"{m['speedup']:7.2f}x "
            f"{m['efficiency']:7.3f} "
            f"{100 * m['bubble_ratio']:6.1f}% {m['max_staleness']:6d} {m['peak_memory_gb']:8.1f}"
        )
    return "\n".join(lines)


def _describe_all(shapes: Mapping[str, Shape]) -> str:
    if len(shapes) == 1:
        return next(iter(shapes.values())).describe()
    return "; ".join(f"{name}: {shape.describe()}" for name, shape in shapes.items())


def allowed_policies(scenario: Scenario) -> list[str]:
    """Every policy that can schedule the scenario's pipelines (their kinds; several pipelines: one that
    multiplexes), the scenario's own `schedule.policies` first."""
    kinds = {pipeline.kind for pipeline in scenario.pipelines}
    every = [
        name
        for name in POLICIES
        if kinds <= policy_class(name).pipeline_kinds
        and (len(scenario.pipelines) == 1 or policy_class(name).multiplexes)
    ]
    return list(dict.fromkeys([*scenario.schedule.policies, *every]))


def plan(scenario: Scenario, devices: int, policies: list[str] | None = None) -> str:
    """What each policy considered on `devices` and what it chose — every policy that can schedule the scenario
    (`allowed_policies`), or `policies`: every candidate its search simulated over the run's steps (at most
    `SEARCH_STEPS`), fastest first, the chosen one marked `*` — it is never slower than another row of its policy —,
    with its throughput once warm (a step's samples over its steady step, commit to commit after the first), its
    steady step and first step (warm-up included), beside the first policy's throughput; last, the best, why it
    beats the runner-up, and how to run it. The best is the policy whose chosen shape has the shortest steady step: a
    run takes hundreds of steps, so a slower first step (a pipelined shape's warm-up) weighs next to nothing; the
    throughput over the few simulated steps would count it as much as every later step. So the best line gives the
    throughput once warm first: on Search-R1's agentic scenario, over its two simulated steps jigsaw makes more
    samples/s than streamrl (whose first step rolls out on half the pool, then trains, nothing overlapped yet), but
    once warm streamrl rolls a step out beside the previous one's training and steps faster than jigsaw, which opens
    a step on the previous one's published weights."""
    with collector_paused():  # every policy's candidates' graphs and traces are kept until the plan is printed
        return _plan(scenario, devices, policies)


def _plan(scenario: Scenario, devices: int, policies: list[str] | None) -> str:
    names = list(dict.fromkeys(policies or allowed_policies(scenario)))
    for name in names:
        policy_class(name)
    reward = scenario.schedule.reward_devices
    needed = scenario.pipelines[0].min_plan_devices
    if devices - reward < needed:
        raise ValueError(
            f"--devices must be at least {needed} (a rollout and a trainer pool) besides {reward} reward devices, "
            f"got {devices}"
        )
    steps = search_horizon(scenario.schedule.steps)
    # One cost model for every policy: a search's enumeration is memoized per model (`sched.digen_search`), so
    # digen+tcss ranks the cuts digen already priced instead of pricing them again.
    cost = CostModel(scenario.cluster.catalogue_device())
    lines = [f"plan for {scenario.name} on {devices}x {scenario.cluster.device}, simulated over {steps} steps"]
    baseline: float | None = None
    chosen_by_policy: dict[str, Searched] = {}
    simulations: dict = {}  # digen+tcss simulates the candidates it runs as digen does once, not again
    for name in names:
        searched: list[Searched] = []
        try:
            prepared = prepare(
                scenario, name, steps=steps, devices=devices, cost=cost, searched=searched, simulations=simulations
            )
        except ValueError as error:
            lines.append(f"{name}: cannot run: {' '.join(str(error).split())}")
            continue
        rows = [s for s in searched if s.horizon == steps]
        chosen = prepared.setup.shapes
        if not any(row.shapes == chosen for row in rows):  # no search, or the search ran nothing this long
            rows.append(searched_from(name, dict(chosen), steps, run_prepared(scenario, prepared)))
        rows.sort(key=lambda row: -row.samples_per_s)
        pick = next(row for row in rows if row.shapes == chosen)
        chosen_by_policy[name] = pick
        baseline = baseline or pick.samples_per_s
        screened = len(searched) - sum(1 for s in searched if s.horizon == steps)
        lines.append(
            f"{name}: {len(rows)} candidate{'s' if len(rows) > 1 else ''} simulated"
            + (f" (after a one-step screen of {screened})" if screened else "")
        )
        for row in rows:
            mark = "*" if row.shapes == chosen else " "
            lines.append(
                f"  {mark} {row.samples_per_s:10.3f} samples/s ({row.steady_samples_per_s:.3f} once warm) "
                f"{row.steady_step_s:9.1f} s/step steady (first {row.first_step_s:.1f} s) "
                f"{row.samples_per_s / baseline:6.2f}x  {_describe_all(row.shapes)}"
            )
    if not chosen_by_policy:
        raise ValueError(f"{scenario.name}: no policy can run it on {devices} devices:\n" + "\n".join(lines[1:]))
    ranked = sorted(chosen_by_policy.items(), key=lambda item: (item[1].steady_step_s, -item[1].samples_per_s))
    name, best = ranked[0]
    lines.append(
        f"best: {_describe_all(best.shapes)} under {name} -> {best.steady_samples_per_s:.3f} samples/s once warm "
        f"({best.samples_per_s:.3f} over the {steps} simulated steps), {best.steady_step_s:.1f} s/step steady "
        f"(first step {best.first_step_s:.1f} s); "
        f"{how_to_run(scenario, name, devices)}"
    )
    same = [other for other, row in ranked[1:] if _describe_all(row.shapes) == _describe_all(best.shapes)]
    if same:  # another policy chose the same shapes (jigsaw-greedy often does jigsaw's): no contest with it
        lines.append(f"the same shapes under {', '.join(same)}")
    rivals = [(other, row) for other, row in ranked[1:] if other not in same]
    if rivals:
        lines.append(why_it_wins(name, best, *rivals[0]))
    return "\n".join(lines)


def why_it_wins(name: str, best: Searched, runner_name: str, runner: Searched) -> str:
    """One line: how much shorter the best policy's steady step is than the runner-up's, and the kind of work (or
    idle time) whose seconds a step differ most between them, with both figures."""
    kinds = sorted(best.phase_s.keys() | runner.phase_s.keys())
    saved = {kind: runner.phase_s.get(kind, 0.0) - best.phase_s.get(kind, 0.0) for kind in kinds}
    kind = max(kinds, key=lambda k: saved[k])
    gap = runner.steady_step_s - best.steady_step_s
    return (
        f"why: {name} steps {gap:.1f} s faster than {runner_name} once warm ({best.steady_step_s:.1f} vs "
        f"{runner.steady_step_s:.1f} s); most of it {kind}: {runner.phase_s.get(kind, 0.0):.1f} s a step under "
        f"{runner_name}, {best.phase_s.get(kind, 0.0):.1f} s under {name} (device-seconds of the step over the devices)"
    )


def how_to_run(scenario: Scenario, policy: str, devices: int) -> str:
    """The run config's keys that run `policy` as planned. The shape is not among them: the policy cuts it itself
    when the run starts, a searching one by the same search on the costs the run profiles on its own devices."""
    keys = f"policy={policy} cluster.device={scenario.cluster.device} cluster.devices={devices}"
    if scenario.schedule.reward_devices:
        keys += f" runtime.reward_devices={scenario.schedule.reward_devices}"
    how = "searches its shape itself as the run starts" if policy_class(policy).searches else "cuts this shape itself"
    return f"to run it, set {keys} in the run config ({policy} {how})"
