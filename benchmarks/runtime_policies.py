"""Side by side on this machine: every runtime policy on the same workload, measured and simulated.

    .venv/bin/python benchmarks/runtime_policies.py --steps 20 --out runs/bench

For each policy: samples/s and step time between optimizer steps (median over steps after the first),
efficiency and per-device bubble ratio from the real trace, the step time `dovetail train --dry-run` predicted
before the run, and the simulator's replay of the run (`dovetail simulate --from-run`: the run's graph with its
measured costs).
Prints a Markdown table for BENCHMARKS.md.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from dovetail.config.train import load_config
from dovetail.exec.launch import dry_run
from dovetail.exec.replay import replay_run
from dovetail.train import train

POLICIES = ("reference", "colocated", "disaggregated", "digen", "digen+tcss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every policy")
    args = parser.parse_args()

    rows = []
    for policy in args.policies.split(","):
        config = load_config(None, [f"policy={policy}", "eval.every=1000", "checkpoint.every=1000", *args.overrides])
        out = args.out / policy
        predicted = dry_run(config, args.steps).get("step_time_s")
        start = time.perf_counter()
        summary = train(config, out, steps=args.steps)
        wall = time.perf_counter() - start
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
        step_s = statistics.median(m.get("step_s", 64 / m["samples_per_s"]) for m in lines)
        row = {
            "policy": policy,
            "samples_per_s": statistics.median(m["samples_per_s"] for m in lines),
            "step_s": step_s,
            "wall_s": wall,
            "final_eval_reward": summary["final_eval_reward"],
        }
        if policy != "reference":
            replay = replay_run(out)
            row |= {
                "efficiency": statistics.median(m["efficiency"] for m in lines),
                "bubble": [round(statistics.median(m["bubble_ratio_per_device"][d] for m in lines), 3) for d in range(config.cluster.devices)],
                "dry_run_step_s": predicted,
                "measured_run_step_s": replay["measured_step_time_s"],
                "simulated_run_step_s": replay["predicted_step_time_s"],
                "simulator_error": replay["relative_error"],
            }
        rows.append(row)
        print(json.dumps(row), flush=True)

    base = rows[0]["samples_per_s"]
    print("\n| policy | samples/s | speedup | step (s) | efficiency | bubble per device | dry-run step (s) | replayed step (s) "
          "| measured step (s) | replay error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sim = (f"{r['dry_run_step_s']:.3f} | {r['simulated_run_step_s']:.3f} | {r['measured_run_step_s']:.3f} | {r['simulator_error']:+.1%}"
               if "simulator_error" in r else "— | — | — | —")
        eff = f"{r['efficiency']:.3f} | {r['bubble']}" if "efficiency" in r else "1 device | —"
        print(f"| {r['policy']} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base:.2f}x | {r['step_s']:.3f} | {eff} | {sim} |")


if __name__ == "__main__":
    main()
