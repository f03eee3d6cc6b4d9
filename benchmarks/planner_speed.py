"""How long the planner takes at the sizes users plan: CPU seconds of one `simulate` per shipped scenario and policy,
and of `dovetail plan` (every policy the scenario's kinds allow, searches included) on each pool asked for.

    python benchmarks/planner_speed.py [--scenarios jigsaw-64xa100 ...] [--policies verl-sync jigsaw] [--steps 1]
        [--devices 64] [--pools 8 16 32 64 128 256] [--repeats 3]

`--policies` defaults to every policy the scenario's kinds allow (`plan.report.allowed_policies`); `--devices` simulates
on that many devices instead of the scenario's own; `--pools` times `plan` on each pool (default:
the scenario's own devices) and their sum, what sweeping a scenario over pool sizes costs (issue 38 asks for a 64-device
simulate under 1 s and a plan over every policy on 8-256 devices under 10 s).

CPU time of this process (`time.process_time`), the median of `--repeats`: the simulator's own work, which wall time on
a shared machine would blur. A figure belongs in BENCHMARKS.md with this command, the machine and the date; the suite
checks only that these simulate and plan (tests/test_policies_lm.py, tests/test_cli_simulate.py), since a bound in
seconds fails on a slower machine."""

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

from dovetail.plan.prepare import simulate
from dovetail.plan.report import allowed_policies, plan
from dovetail.plan.scenario import load_scenario


def timed(work: Callable[[], object], repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.process_time()
        work()
        seconds.append(time.process_time() - start)
    return seconds


def row(scenario: str, what: str, devices: int | str, seconds: list[float]) -> str:
    return (
        f"{scenario:<28} {what:<14} {devices:>7} {statistics.median(seconds):>15.2f} "
        f"{min(seconds):>7.2f} {max(seconds):>7.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=["jigsaw-64xa100"])
    parser.add_argument("--policies", nargs="+", default=None, help="default: every policy the scenario allows")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument(
        "--devices", type=int, default=None, help="simulate on this many devices (default: the scenario's)"
    )
    parser.add_argument(
        "--pools", nargs="+", type=int, default=None, help="plan on each (default: the scenario's devices)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'scenario':<28} {'policy':<14} {'devices':>7} {'CPU s (median)':>15} {'min':>7} {'max':>7}")
    for name in args.scenarios:
        scenario = load_scenario(name)
        devices = args.devices or scenario.cluster.devices
        allowed = allowed_policies(scenario)
        refused = [policy for policy in args.policies or () if policy not in allowed]
        if refused:
            parser.error(f"--policies: {name} does not run {', '.join(refused)}; its kinds allow {', '.join(allowed)}")
        for policy in args.policies or allowed:
            seconds = timed(partial(simulate, scenario, policy, steps=args.steps, devices=devices), args.repeats)
            print(row(name, policy, devices, seconds))
        pools = args.pools or [scenario.cluster.devices]
        total = [0.0] * args.repeats
        for pool in pools:
            seconds = timed(partial(plan, scenario, pool), args.repeats)
            total = [t + s for t, s in zip(total, seconds)]
            print(row(name, "plan", pool, seconds))
        if len(pools) > 1:
            print(row(name, "plan (sum)", f"{min(pools)}-{max(pools)}", total))


if __name__ == "__main__":
    main()
