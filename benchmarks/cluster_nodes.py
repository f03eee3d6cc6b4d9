"""The same 2-device run on one node and on two nodes of a Ray cluster on this machine: what the cross-node path costs.

    .venv/bin/python benchmarks/cluster_nodes.py --steps 10 --rounds 3 --out runs/bench-nodes
    .venv/bin/python benchmarks/cluster_nodes.py --publication object_store collective auto   # the two-node paths

Both arrangements are clusters of this machine's cores (`ray.cluster_utils.Cluster`, every server on loopback), a
head without devices and either one node of 2 `dovetail_device`s or two nodes of one each, so that they differ only
in where the devices are: on one node the workers share its object store; on two, every rollout, score, published
weights and trainer state a device reads from the other crosses between the nodes' object stores (Ray's object
manager), and the trainer group's gloo connections span them. `--publication` runs the two-node arrangement under
each `cluster.publication` setting given (the weights through the object store, by a gloo broadcast, or as `auto`
measures them at start-up; its timings are in the last column). Each run is a process of its own (a driver joins one
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

NODES = {"one node": [2], "two nodes": [1, 1]}
"""Devices of each node besides the head."""
CONFIG = ["policy=digen", "eval.every=1000", "checkpoint.every=1000", "cluster.devices=2"]


def arrangements(publications: list[str]) -> dict[str, tuple[list[int], str]]:
    """Each row's nodes and cluster.publication: one node (where auto measures nothing), then two nodes under each
    setting."""
    two = {f"two nodes, {setting}": (NODES["two nodes"], setting) for setting in publications}
    return {"one node": (NODES["one node"], "auto")} | two


def run_on_cluster(nodes: list[int], publication: str, steps: int, out: Path) -> dict:
    """One run of configs/digits.yaml's workload on a fresh cluster of `nodes`; its figures."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from dovetail import train
    from dovetail.config.load import load_config
    from dovetail.runtime.ray_start import DEVICE_RESOURCE, LOOPBACK

    ray_constants.ENABLE_RAY_CLUSTER = False  # every node on loopback, as a local run's
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK})
    try:
        for devices in nodes:
            cluster.add_node(num_cpus=0, resources={DEVICE_RESOURCE: devices}, node_ip_address=LOOPBACK)
        config = load_config(
            None, [*CONFIG, f"cluster.address={cluster.address}", f"cluster.publication={publication}"]
        )
        start = time.perf_counter()
        summary = train(config, out=out, steps=steps, overwrite=True)
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
        "publication": next(iter(summary["publication"].values())),
    }


def predicted(steps: int) -> float:
    from dovetail.config.load import load_config
    from dovetail.runtime.launch import dry_run

    return dry_run(load_config(None, CONFIG), steps)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-nodes"))
    parser.add_argument(
        "--publication",
        nargs="+",
        default=["object_store"],
        choices=["object_store", "collective", "auto"],
        help="cluster.publication settings of the two-node runs, a row each",
    )
    parser.add_argument("--arrangement", help=argparse.SUPPRESS)  # one run, as a child
    args = parser.parse_args()
    rows_of = arrangements(args.publication)
    if args.arrangement:
        nodes, publication = rows_of[args.arrangement]
        out = args.out / args.arrangement.replace(" ", "-").replace(",", "")
        print(json.dumps(run_on_cluster(nodes, publication, args.steps, out)))
        return
    rows: dict[str, list[dict]] = {name: [] for name in rows_of}
    for _ in range(args.rounds):
        for name in rows_of:
            command = [
                sys.executable,
                __file__,
                "--arrangement",
                name,
                "--steps",
                str(args.steps),
                "--out",
                str(args.out),
                "--publication",
                *args.publication,
            ]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            rows[name].append(json.loads(result.stdout.strip().splitlines()[-1]))
    prediction = predicted(args.steps)
    one = statistics.median(r["samples_per_s"] for r in rows["one node"])
    print(f"digen on 2 devices, configs/digits.yaml, {args.steps} steps, {args.rounds} rounds interleaved")
    print(
        "| arrangement | samples/s (median, range) | vs one node | publish s (median, range) | commit s "
        "| start-up s | dry run | auto: object store / collective s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in rows.items():
        rates = [r["samples_per_s"] for r in runs]
        median = statistics.median(rates)
        publish = [r["publish_s"] for r in runs]
        measured = [r["publication"] for r in runs if r["publication"]["collective_s"] is not None]
        timings = ", ".join(
            f"{m['object_store_s'] * 1e3:.1f} / {m['collective_s'] * 1e3:.1f} ms: {m['path']}" for m in measured
        )
        print(
            f"| {name} | {median:.1f} ({min(rates):.1f}-{max(rates):.1f}) | {median / one:.2f}x "
            f"| {statistics.median(publish):.4f} ({min(publish):.4f}-{max(publish):.4f}) "
            f"| {statistics.median(r['commit_s'] for r in runs):.3f} "
            f"| {statistics.median(r['startup_s'] for r in runs):.1f} | {prediction:.1f} | {timings or '-'} |"
        )


if __name__ == "__main__":
    main()
