"""Side by side on this machine: every runtime policy on the same workload, measured and simulated.

    .venv/bin/python benchmarks/runtime_policies.py --steps 20 --repeats 3 --out runs/bench
    .venv/bin/python benchmarks/runtime_policies.py --kind lm --steps 10 --repeats 3 --out runs/bench-lm

`--kind flow` runs the digits text-to-image model, `--kind lm` LM GRPO on the sort task's tiny language model
(`configs/sort.yaml`'s workload; tokens/s counts generated response tokens). `reference-2t` is the one-process
reference with two torch threads: the plainest competent use of the two cores the Ray policies get.

For each policy: samples/s and step time between optimizer steps (median over steps after the first), the same
step by the wall clock (between the steps' records, as a callback sees them), the physical limit of its devices,
efficiency and per-device bubble ratio from the real trace, the step time `dovetail train --dry-run` predicted
before the run, and the simulator's replay of the run (`dovetail simulate --from-run`: the run's graph with its
measured costs); then each policy's phases: the device-seconds a step spent on each kind of work, summed over
devices (metrics.jsonl's `{kind}_s`; `publish_s` is the step's publication as its rollout devices timed it). The
policies run in turn, `--repeats` rounds of them, so that the machine's drift falls on all alike; the tables give
each figure's median over the rounds and the range of samples/s. Prints Markdown tables for BENCHMARKS.md.
"""

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from dovetail import train
from dovetail.config.load import load_config
from dovetail.graph.node import Kind
from dovetail.runtime.launch import dry_run
from dovetail.runtime.replay import replay_run

POLICIES = {
    "flow": ("reference", "reference-2t", "colocated", "disaggregated", "digen", "digen+tcss"),
    "lm": ("reference", "reference-2t", "verl-sync", "streamrl", "areal"),
}
TWO_THREADS = "reference-2t"
"""The plainest competent use of two cores: the one-process reference loop with two torch threads (a run pins one
per process; this baseline lifts that pin for the reference alone)."""
WORKLOADS = {"flow": [], "lm": ["kind=lm", "task=sort", "algo.prompts_per_step=32", "train.lr=2e-4"]}
PHASES = [f"{kind}_s" for kind in Kind]
"""metrics.jsonl's per-step device-seconds of each kind of work (`publish_s`: the publication's own timing)."""


class StepClock:
    """A `train` callback: the wall clock at each step's record."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step(self, metrics: dict, pipeline: str) -> None:
        self.times.append(time.perf_counter())

    def steady_step_s(self) -> float:
        """The median time between records after the second step's (the first step warms up)."""
        return statistics.median(b - a for a, b in zip(self.times[1:], self.times[2:]))


def read_steps(out: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steady_figures(lines: list[dict], samples_per_step: int) -> dict:
    """Median samples/s, step time and (LM) response tokens/s over `lines`: pass the steps after the first, which
    pays for warming up (the engines' first passes, Ray's first tasks)."""
    return {
        "samples_per_s": statistics.median(m["samples_per_s"] for m in lines),
        "step_s": statistics.median(samples_per_step / m["samples_per_s"] for m in lines),
        "tokens_per_s": statistics.median(m["response_tokens"] * m["samples_per_s"] / samples_per_step for m in lines)
        if "response_tokens" in lines[0]
        else None,
    }


@contextmanager
def torch_threads(threads: int):
    """`threads` torch threads for the run in this process, whatever it asks for (`train` sets one)."""
    pinned = torch.set_num_threads
    pinned(threads)
    torch.set_num_threads = lambda _: None
    try:
        yield
    finally:
        torch.set_num_threads = pinned
        pinned(1)


def measure(policy: str, steps: int, out: Path, overrides: list[str]) -> dict:
    threads = 2 if policy == TWO_THREADS else 1
    run_policy = "reference" if policy == TWO_THREADS else policy
    config = load_config(None, [f"policy={run_policy}", "eval.every=1000", "checkpoint.every=1000", *overrides])
    samples_per_step = config.algo.prompts_per_step * config.algo.group_size
    predicted = dry_run(config, steps).get("step_time_s")
    clock = StepClock()
    start = time.perf_counter()
    with torch_threads(threads):
        summary = train(
            config, out=out, steps=steps, overwrite=True, callbacks=[clock]
        )  # a re-run replaces its earlier one
    wall = time.perf_counter() - start
    lines = read_steps(out)[1:]
    row = {
        "policy": policy,
        **steady_figures(lines, samples_per_step),
        "clock_step_s": clock.steady_step_s(),
        "devices": threads if run_policy == "reference" else config.cluster.devices,
        "phases": {p: statistics.median(m[p] for m in lines) for p in PHASES if p in lines[0]},
        "max_staleness": max(m.get("staleness", 0) for m in lines),
        "wall_s": wall,
        "final_eval_reward": summary["final_eval_reward"],
    }
    if run_policy != "reference":
        replay = replay_run(out)
        row |= {
            "occupancy": statistics.median(m["occupancy"] for m in lines),
            "idle": [
                statistics.median(1 - m["occupancy_per_device"][d] for m in lines)
                for d in range(config.cluster.devices)
            ],
            "dry_run_step_s": predicted,
            "measured_run_step_s": replay["measured_step_time_s"],
            "simulated_run_step_s": replay["predicted_step_time_s"],
            "simulator_error": replay["relative_error"],
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--kind", choices=sorted(POLICIES), default="flow")
    parser.add_argument("--policies", help="comma-separated; default: every runtime policy of the kind")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every policy")
    args = parser.parse_args()

    policies = args.policies.split(",") if args.policies else list(POLICIES[args.kind])
    overrides = [*WORKLOADS[args.kind], *args.overrides]
    rounds: dict[str, list[dict]] = {policy: [] for policy in policies}
    for repeat in range(args.repeats):
        for policy in policies:
            row = measure(policy, args.steps, args.out / str(repeat) / policy, overrides)
            rounds[policy].append(row)
            print(json.dumps(row), flush=True)

    def median(policy: str, key: str):
        return statistics.median(row[key] for row in rounds[policy])

    base = median(policies[0], "samples_per_s")
    print(
        "\n| policy | samples/s (median, range) | speedup | limit | tokens/s | step (s) | step by clock (s) | "
        "max staleness | occupancy | idle per device | dry-run step (s) | replayed step (s) | measured step (s) | "
        "replay error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for policy in policies:
        rows = rounds[policy]
        rate = median(policy, "samples_per_s")
        spread = f"{rate:.1f} ({min(r['samples_per_s'] for r in rows):.1f}-{max(r['samples_per_s'] for r in rows):.1f})"
        if "occupancy" in rows[0]:
            idle = [round(statistics.median(r["idle"][d] for r in rows), 3) for d in range(len(rows[0]["idle"]))]
            cells = (
                f"{median(policy, 'occupancy'):.3f} | {idle} | {median(policy, 'dry_run_step_s'):.3f} | "
                f"{median(policy, 'simulated_run_step_s'):.3f} | {median(policy, 'measured_run_step_s'):.3f} | "
                f"{median(policy, 'simulator_error'):+.1%}"
            )
        else:
            cells = "1 device | — | — | — | — | —"
        tokens = f"{median(policy, 'tokens_per_s'):.0f}" if rows[0]["tokens_per_s"] is not None else "—"
        stale = max(r["max_staleness"] for r in rows)
        print(
            f"| {policy} | {spread} | {rate / base:.2f}x | {rows[0]['devices']}x | {tokens} | "
            f"{median(policy, 'step_s'):.3f} | {median(policy, 'clock_step_s'):.3f} | {stale} | {cells} |"
        )
    phases = [p for p in PHASES if any(p in rounds[policy][0]["phases"] for policy in policies)]
    print(f"\n| policy | {' | '.join(p.removesuffix('_s') for p in phases)} | step (s) |")
    print(f"|---|{'---|' * len(phases)}---|")
    for policy in policies:
        cells = [
            f"{statistics.median(r['phases'][p] for r in rounds[policy]):.3f}"
            if p in rounds[policy][0]["phases"]
            else "—"
            for p in phases
        ]
        print(f"| {policy} | {' | '.join(cells)} | {median(policy, 'step_s'):.3f} |")


if __name__ == "__main__":
    main()
