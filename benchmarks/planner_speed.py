"""How long the planner takes at the sizes users plan: CPU seconds of one `simulate` per shipped scenario and policy,
and of `dovetail plan` (every policy of the scenario's schedule, searches included) on its own devices.

    python benchmarks/planner_speed.py [--scenarios jigsaw-64xa100 ...] [--policies verl-sync jigsaw] [--steps 1]

CPU time of this process (`time.process_time`), the median of `--repeats`: the simulator's own work, which wall time on
a shared machine would blur. A figure belongs in BENCHMARKS.md with this command, the machine and the date; the suite
checks only that these simulate and plan (tests/test_policies_lm.py, tests/test_cli_simulate.py), since a bound in
seconds fails on a slower machine."""

import argparse
import statistics
import time

from dovetail.plan.prepare import simulate
from dovetail.plan.report import plan
from dovetail.plan.scenario import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=["jigsaw-64xa100"])
    parser.add_argument("--policies", nargs="+", default=["verl-sync", "jigsaw"])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'scenario':<28} {'policy':<12} {'devices':>7} {'CPU s (median)':>15} {'min':>7} {'max':>7}")
    for name in args.scenarios:
        scenario = load_scenario(name)
        for policy in args.policies:
            seconds = []
            for _ in range(args.repeats):
                start = time.process_time()
                simulate(scenario, policy, steps=args.steps)
                seconds.append(time.process_time() - start)
            print(
                f"{name:<28} {policy:<12} {scenario.cluster.devices:>7} {statistics.median(seconds):>15.2f} "
                f"{min(seconds):>7.2f} {max(seconds):>7.2f}"
            )
        seconds = []
        for _ in range(args.repeats):
            start = time.process_time()
            plan(scenario, scenario.cluster.devices)
            seconds.append(time.process_time() - start)
        print(
            f"{name:<28} {'plan':<12} {scenario.cluster.devices:>7} {statistics.median(seconds):>15.2f} "
            f"{min(seconds):>7.2f} {max(seconds):>7.2f}"
        )


if __name__ == "__main__":
    main()
