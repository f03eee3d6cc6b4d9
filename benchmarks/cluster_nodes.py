"""The same 2-device run on one node and on two nodes of a Ray cluster on this machine: what the cross-node path costs.

    .venv/bin/python benchmarks/cluster_nodes.py --steps 10 --rounds 3 --out runs/bench-nodes

Both arrangements are clusters of this machine's cores (`ray.cluster_utils.Cluster`, every server on loopback), a
head without devices and either one node of 2 `dovetail_device`s or two nodes of one each, so that they differ only
in where the devices are: on one node the workers share its object store; on two, every rollout, score, published
weights and trainer state a device reads from the other crosses between the nodes' object stores (Ray's object
manager), and the trainer group's gloo connections span them. Each run is a process of its own (a driver joins one
Ray instance), the arrangements alternate for `--rounds` rounds, and the table gives medians over the rounds with
their ranges, beside what `dovetail train --dry-run` predicts (the cost model counts a CPU core as a node of its own
whatever Ray calls a node, so it predicts the two alike). Prints a Markdown table for BENCHMARKS.md.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARRANGEMENTS = {"one node": [2], "two nodes": [1, 1]}
"""Devices of each node besides the head."""
CONFIG = ["policy=digen", "eval.every=1000", "checkpoint.every=1000", "cluster.devices=2"]


def run_on_cluster(nodes: list[int], steps: int, out: Path) -> dict:
    """One run of configs/digits.yaml's workload on a fresh cluster of `nodes`; its figures."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from dovetail.config.load import load_config
    from dovetail.exec.worker import DEVICE_RESOURCE, LOOPBACK
    from dovetail.runner import train

    ray_constants.ENABLE_RAY_CLUSTER = False  # every node on loopback, as a local run's
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK})
    try:
        for devices in nodes:
            cluster.add_node(num_cpus=0, resources={DEVICE_RESOURCE: devices}, node_ip_address=LOOPBACK)
        config = load_config(None, [*CONFIG, f"cluster.address={cluster.address}"])
        start = time.perf_counter()
        summary = train(config, out, steps=steps, overwrite=True)
        wall = time.perf_counter() - start
    finally:
        ray.shutdown()
        cluster.shutdown()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return {
        "samples_per_s": statistics.median(m["samples_per_s"] for m in lines),
        "publish_s": statistics.median(m["publish_s"] for m in lines),
        "commit_s": statistics.median(m.get("commit_s", 0.0) for m in lines),
        "startup_s": summary["startup_s"],
        "wall_s": wall,
    }


def predicted(steps: int) -> float:
    from dovetail.config.load import load_config
    from dovetail.exec.launch import dry_run

    return dry_run(load_config(None, CONFIG), steps)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-nodes"))
    parser.add_argument("--arrangement", choices=sorted(ARRANGEMENTS), help=argparse.SUPPRESS)  # one run, as a child
    args = parser.parse_args()
    if args.arrangement:
        row = run_on_cluster(ARRANGEMENTS[args.arrangement], args.steps, args.out / args.arrangement.replace(" ", "-"))
        print(json.dumps(row))
        return
    rows: dict[str, list[dict]] = {name: [] for name in ARRANGEMENTS}
    for _ in range(args.rounds):
        for name in ARRANGEMENTS:
            command = [
                sys.executable,
                __file__,
                "--arrangement",
                name,
                "--steps",
                str(args.steps),
                "--out",
                str(args.out),
            ]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            rows[name].append(json.loads(result.stdout.strip().splitlines()[-1]))
    prediction = predicted(args.steps)
    one = statistics.median(r["samples_per_s"] for r in rows["one node"])
    print(f"digen on 2 devices, configs/digits.yaml, {args.steps} steps, {args.rounds} rounds interleaved")
    print("| arrangement | samples/s (median, range) | vs one node | publish s | commit s | start-up s | dry run |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in rows.items():
        rates = [r["samples_per_s"] for r in runs]
        median = statistics.median(rates)
        print(
            f"| {name} | {median:.1f} ({min(rates):.1f}-{max(rates):.1f}) | {median / one:.2f}x "
            f"| {statistics.median(r['publish_s'] for r in runs):.3f} "
            f"| {statistics.median(r['commit_s'] for r in runs):.3f} "
            f"| {statistics.median(r['startup_s'] for r in runs):.1f} | {prediction:.1f} |"
        )


if __name__ == "__main__":
    main()
