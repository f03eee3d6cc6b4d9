"""Two agentic pipelines on one pool of 2 local devices, their trajectories waiting on a tool between turns:
multiplexed (jigsaw) against the ways to run them without multiplexing, measured one after the other in one
invocation, and the simulator's figure for each beside it.

    .venv/bin/python benchmarks/agentic_multiplex.py [--config configs/multiplex-agentic.yaml] [--steps 6] [--out ...]

The pipelines are the multiplex config's (configs/multiplex-agentic.yaml: the calc task on two problem streams, each
environment step waiting `env.latency`), with the same batches and steps in every arrangement:
  back-to-back   each alone on both devices under its fastest measured policy of verl-sync, streamrl and areal, in
                 turn (every policy is run: the table lists each)
  split-pool     each on one device (its own core, `taskset`) under verl-sync, at the same time
  jigsaw         one multiplexed run (the look-ahead scheduler and its shape search), each step on-policy
  jigsaw-stale1  the same with `staleness: 1`: a pipeline's next step rolls out while its step trains, one version
                 behind at most (streamrl's bound)
  jigsaw-stale4  `staleness: 4` (areal's default bound, the back-to-back baseline's)

Every arrangement runs its rollouts with free waits (`env.free_waits: true`, `--waits free`, the default): each turn
a node of its own, the environment's steps and waits off the devices, so a device whose trajectories all wait is the
policy's to fill; `--waits held` runs them as before, each shard's trajectories rolled out whole by one decode call
that holds its device through the waits.

Time is the training itself, as benchmarks/multiplex.py counts it (its helpers): a pipeline's time is the sum of its
steps' `step_s`, an arrangement's makespan adds the pipelines that ran in turn and takes the longest of those that
ran together, a multiplexed run's is its trace's first node to its last optimizer step. Per arrangement: device busy
(the pool's device-seconds with a node on them over 2 x the makespan: with held waits a rollout engine that sleeps
while every trajectory waits still holds its device, so this counts it busy; with free waits it does not) and
env-wait (`env/wait_s` summed over 2 x the makespan: with held waits the seconds the rollout engines slept with every
trajectory waiting, with free waits the seconds the env nodes waited, off the devices). The simulator's samples/s
comes from `dry_run` on one profile of each pipeline taken in this process, shared by every arrangement's forecast
(so they compare like with like), each arrangement's graph in the runtime's shape (`--waits`); the last column is the
other shape's forecast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from multiplex import busy_seconds, finish, multiplexed_tree, pipeline_figures, pipelines, run, training_seconds

ROOT = Path(__file__).resolve().parent.parent
ALONE = ("verl-sync", "streamrl", "areal")
"""The policies a pipeline alone on the pool is measured under: its best is the fastest of them."""
STALENESS = (1, 4)
"""The staleness bounds jigsaw runs under besides on-policy: streamrl's and areal's default."""


def waited_seconds(run_dir: Path) -> float:
    """Seconds the run's rollout engines slept with every trajectory waiting on its environment (`env/wait_s`)."""
    return sum(json.loads(line)["env/wait_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())


def alone(configs: dict[str, dict], out: Path) -> dict[str, dict[str, dict]]:
    """Each pipeline alone on both devices under each policy of ALONE: pipeline -> policy -> its figures."""
    measured: dict[str, dict[str, dict]] = {}
    for name, config in configs.items():
        for policy in ALONE:
            run_dir = out / f"alone-{name}-{policy}"
            finish([run(config | {"policy": policy}, run_dir)])
            figures = pipeline_figures(run_dir) | {"busy": busy_seconds(run_dir), "waited": waited_seconds(run_dir)}
            measured.setdefault(name, {})[policy] = figures
            print(f"  {name} alone under {policy}: {figures['step_s']:.2f} s/step", flush=True)
    return measured


def back_to_back(measured: dict[str, dict[str, dict]]) -> dict:
    """Each pipeline under its fastest measured policy, in turn."""
    best = {name: min(by_policy, key=lambda p: by_policy[p]["seconds"]) for name, by_policy in measured.items()}
    chosen = {name: measured[name][policy] for name, policy in best.items()}
    makespan = sum(f["seconds"] for f in chosen.values())
    return {
        "policies": best,
        "makespan": makespan,
        "samples": sum(f["samples"] for f in chosen.values()),
        "busy": sum(f["busy"] for f in chosen.values()),
        "waited": sum(f["waited"] for f in chosen.values()),
    }


def split_pool(configs: dict[str, dict], out: Path) -> dict:
    processes = [
        run(c | {"policy": "verl-sync"}, out / f"split-{name}", ["cluster.devices=1"], cores=str(core))
        for core, (name, c) in enumerate(configs.items())
    ]
    finish(processes)
    figures = {name: pipeline_figures(out / f"split-{name}") for name in configs}
    return {
        "makespan": max(f["seconds"] for f in figures.values()),
        "samples": sum(f["samples"] for f in figures.values()),
        "busy": sum(busy_seconds(out / f"split-{name}") for name in configs),
        "waited": sum(waited_seconds(out / f"split-{name}") for name in configs),
    }


def stale(tree: dict, staleness: int) -> dict:
    """A multiplexed run's tree with jigsaw's `staleness`."""
    return tree | {"staleness": staleness}


def multiplexed(configs: dict[str, dict], out: Path, staleness: int = 0) -> dict:
    run_dir = out / (f"jigsaw-stale{staleness}" if staleness else "jigsaw")
    finish([run(stale(multiplexed_tree("jigsaw", configs), staleness), run_dir)])
    figures = {name: pipeline_figures(run_dir / name) for name in configs}
    return {
        "makespan": training_seconds(run_dir),
        "samples": sum(f["samples"] for f in figures.values()),
        "busy": busy_seconds(run_dir),
        "waited": sum(waited_seconds(run_dir / name) for name in configs),
    }


def with_waits(configs: dict[str, dict], free: bool) -> dict[str, dict]:
    """The pipelines' configs with their waits free of the devices (`env.free_waits`) or held by them."""
    return {name: c | {"env": c["env"] | {"free_waits": free}} for name, c in configs.items()}


def profiled(configs: dict[str, dict]) -> dict[str, dict]:
    """One start-up profile of each pipeline, taken in this process (`profiled_here`), which every arrangement's
    forecast is priced on: two profiles of a loaded machine differ by up to 2x, so a fresh one per arrangement would
    compare the machine's moments rather than the arrangements."""
    from dovetail.config.load import parse_config
    from dovetail.runtime.launch import profiled_here

    return profiled_here(parse_config(multiplexed_tree("jigsaw", configs)))


def predicted(
    configs: dict[str, dict], steps: int, best: dict[str, str], profiles: dict[str, dict]
) -> dict[str, float]:
    """The simulator's samples/s of each arrangement (`dry_run`), all priced on `profiles` (`profiled`)."""
    from dovetail.config.load import parse_config
    from dovetail.runtime.launch import dry_run

    def rate(config: dict, devices: int) -> tuple[float, float]:
        cluster = {"devices": devices, "device": "cpu-core"}
        plan = dry_run(parse_config(config | {"cluster": cluster}), steps, profiles)
        return plan["samples_per_s"], plan["step_time_s"]

    alone = {name: rate(c | {"policy": best[name]}, 2) for name, c in configs.items()}
    split = [rate(c | {"policy": "verl-sync"}, 1) for c in configs.values()]
    return {
        "back-to-back": sum(r * s for r, s in alone.values()) / sum(s for _, s in alone.values()),
        "split-pool": sum(r * s for r, s in split) / max(s for _, s in split),
        "jigsaw": dry_run(parse_config(multiplexed_tree("jigsaw", configs)), steps, profiles)["samples_per_s"],
    } | {
        f"jigsaw-stale{n}": dry_run(parse_config(stale(multiplexed_tree("jigsaw", configs), n)), steps, profiles)[
            "samples_per_s"
        ]
        for n in STALENESS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "multiplex-agentic.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-agentic-multiplex")
    parser.add_argument("--waits", choices=("free", "held"), default="free", help="the rollouts' shape (above)")
    args = parser.parse_args()
    configs = with_waits(pipelines(args.steps, args.config), args.waits == "free")
    started = time.time()
    measured = alone(configs, args.out)
    results = {"back-to-back": back_to_back(measured)}
    print(f"[{time.time() - started:5.0f}s] back-to-back: {results['back-to-back']}", flush=True)
    results["split-pool"] = split_pool(configs, args.out)
    print(f"[{time.time() - started:5.0f}s] split-pool: {results['split-pool']}", flush=True)
    results["jigsaw"] = multiplexed(configs, args.out)
    print(f"[{time.time() - started:5.0f}s] jigsaw: {results['jigsaw']}", flush=True)
    for n in STALENESS:
        results[f"jigsaw-stale{n}"] = multiplexed(configs, args.out, staleness=n)
        print(f"[{time.time() - started:5.0f}s] jigsaw-stale{n}: {results[f'jigsaw-stale{n}']}", flush=True)
    best = results["back-to-back"]["policies"]
    profiles = profiled(configs)
    shape = predicted(configs, args.steps, best, profiles)
    other = predicted(with_waits(configs, args.waits != "free"), args.steps, best, profiles)
    print(
        "| arrangement | makespan s | samples/s | vs back-to-back | device busy | env-wait | simulator samples/s "
        f"| simulator vs back-to-back | {'held' if args.waits == 'free' else 'free'} waits: samples/s, vs "
        "back-to-back |"
    )
    print("|---" * 9 + "|")
    base = results["back-to-back"]["samples"] / results["back-to-back"]["makespan"]
    for name, figures in results.items():
        rate = figures["samples"] / figures["makespan"]
        pool = 2 * figures["makespan"]
        print(
            f"| {name} | {figures['makespan']:.1f} | {rate:.1f} | {rate / base:.2f}x | {figures['busy'] / pool:.2f} | "
            f"{figures['waited'] / pool:.2f} | {shape[name]:.1f} | {shape[name] / shape['back-to-back']:.2f}x | "
            f"{other[name]:.1f}, {other[name] / other['back-to-back']:.2f}x |"
        )
    print(
        "alone, s/step by policy:", {n: {p: round(f["step_s"], 2) for p, f in m.items()} for n, m in measured.items()}
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {"waits": args.waits, "results": results, "alone": measured, "predicted": shape, "predicted_other": other},
            indent=1,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
