"""Compare policies on a scenario and search digen's plan: what `dovetail simulate` and `dovetail plan` print."""

from __future__ import annotations

from pathlib import Path

from dovetail.exec.metrics import summarize
from dovetail.scenario import Scenario, simulate

PLAN_CANDIDATES = 6
"""How many of digen's analytically best shapes `plan` simulates (each with and without TAG and TCSS)."""


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
    """Simulate every policy; the JSON object `dovetail simulate --json` prints. Speedups are over the first."""
    names = policies or scenario.schedule.policies
    result: dict = {"scenario": scenario.name, "devices": scenario.cluster.devices, "policies": {}}
    baseline = None
    for name in names:
        try:
            _, run = simulate(scenario, name, steps=steps)
        except ValueError as error:
            if "GB per device" not in str(error):
                raise
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
        f"{'policy':16s} {'samples/s':>10s} {'step s':>9s} {'speedup':>8s} {'effic.':>7s} {'bubble':>7s} "
        f"{'stale':>6s} {'peak GB':>8s}"
    )
    lines = [f"{result['scenario']} ({result['devices']} devices)", header, "-" * len(header)]
    for name, m in result["policies"].items():
        if "error" in m:
            lines.append(f"{name:16s} does not fit: {m['error']}")
            continue
        lines.append(
            f"{name:16s} {m['samples_per_s']:10.3f} {m['step_time_s']:9.1f} {m['speedup']:7.2f}x "
            f"{m['efficiency']:7.3f} "
            f"{100 * m['bubble_ratio']:6.1f}% {m['max_staleness']:6d} {m['peak_memory_gb']:8.1f}"
        )
    return "\n".join(lines)


def plan_digen(scenario: Scenario, devices: int) -> str:
    """Rank digen shapes (trainer pool and FSDP group, fragments, TSP chunk) by predicted step time under the memory
    limit, simulate the best few with TAG on/off and TCSS off/on, and report the fastest."""
    from dovetail.cost.model import CostModel
    from dovetail.sched.digen import Digen, DigenTCSS

    if len(scenario.pipelines) != 1:
        raise ValueError("plan searches digen, which runs one flow pipeline; this scenario has several")
    scorers = scenario.schedule.reward_devices
    compute = devices - scorers
    if compute < 2:
        raise ValueError(
            f"--devices must be at least 2 (a rollout and a trainer pool) besides {scorers} reward "
            f"devices, got {devices}"
        )
    spec = scenario.pipelines[0]
    cost = CostModel(scenario.cluster.device)
    shapes = {
        shape for cls in (Digen, DigenTCSS) for _, shape in cls.candidates(spec, compute, None, cost)[:PLAN_CANDIDATES]
    }
    baseline = summarize(simulate(scenario, "colocated", devices=devices)[1]).samples_per_s
    rows = []
    for shape in sorted(shapes, key=lambda s: (s.trainer_devices, s.group, s.fragments, s.tsp_chunk)):
        for tcss in (False, True):
            for tag in (True, False):
                name = "digen+tcss" if tcss else "digen"
                _, run = simulate(
                    scenario,
                    name,
                    devices=devices,
                    options={"tag": tag},
                    trainer_devices=shape.trainer_devices,
                    fragments=shape.fragments,
                    tsp_chunk=shape.tsp_chunk,
                    trainer_group=shape.trainer_group,
                )
                rows.append((summarize(run), shape, tcss, tag))
    rows.sort(key=lambda row: -row[0].samples_per_s)
    lines = [
        f"plan for {scenario.name} on {devices}x {scenario.cluster.device} (colocated: {baseline:.3f} samples/s)",
        f"{'trainers':>8s} {'group':>5s} {'fragments':>9s} {'tsp':>4s} {'TAG':>4s} {'TCSS':>5s} "
        f"{'samples/s':>10s} {'speedup':>8s} {'effic.':>7s} {'peak GB':>8s}",
    ]
    for metrics, shape, tcss, tag in rows:
        lines.append(
            f"{shape.trainer_devices:8d} {shape.group:5d} {shape.fragments:9d} {shape.tsp_chunk:4d} "
            f"{'on' if tag else 'off':>4s} "
            f"{'on' if tcss else 'off':>5s} {metrics.samples_per_s:10.3f} {metrics.samples_per_s / baseline:7.2f}x "
            f"{metrics.efficiency:7.3f} {metrics.peak_memory_gb:8.1f}"
        )
    best, shape, tcss, tag = rows[0]
    lines.append(
        f"best: trainer_devices={shape.trainer_devices} (rollout {compute - shape.trainer_devices}"
        f"{f', reward {scorers}' if scorers else ''}, FSDP groups of {shape.group}), fragments={shape.fragments}, "
        f"tsp_chunk={shape.tsp_chunk}, TAG {'on' if tag else 'off'}, TCSS {'on' if tcss else 'off'} -> "
        f"{best.samples_per_s:.3f} samples/s, {best.step_time_s:.1f} s/step"
    )
    return "\n".join(lines)
