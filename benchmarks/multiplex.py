"""An LM pipeline and a flow pipeline on one pool of 2 local devices: multiplexed (jigsaw, jigsaw-greedy) against
the ways to run them without multiplexing, measured side by side in one invocation, interleaved and repeated.

    .venv/bin/python benchmarks/multiplex.py [--config configs/multiplex.yaml] [--steps 10] [--repeats 3] [--out ...]

The pipelines are the two of the multiplex config (configs/multiplex.yaml: sort GRPO and digits FlowGRPO;
configs/multiplex-tail.yaml: the heavy-tailed copy task instead of sort), with the same batches and steps in every
arrangement:
  back-to-back   each alone on both devices under its fastest policy there (LM verl-sync, flow digen: BENCHMARKS'
                 runtime tables), in turn
  split-pool     each in a process of its own pinned to its own core (`taskset`), at its fastest there: the
                 one-process reference loop (no Ray: on one core a Ray policy only adds its hand-offs), at the same
                 time
  async          each alone on both devices under its asynchronous baseline (LM streamrl, flow digen+tcss), in turn
  jigsaw-greedy  one multiplexed run, no look-ahead, the cost model's default shapes
  jigsaw         one multiplexed run, the look-ahead scheduler and its shape search
  jigsaw-split   jigsaw kept to the split pool (`arrangement: split`): each pipeline on a sub-pool of its own

Every arrangement is a fresh `dovetail train` process (its own local Ray instance). Time is the training itself:
a pipeline's time is the sum of its steps' `step_s` (commit to commit, start-up profile and base eval excluded);
an arrangement's makespan adds the pipelines that ran in turn and takes the longest of those that ran together;
a multiplexed run's is its trace's first node to its last optimizer step (its pipelines may have run in turn).
Efficiency is the pool's busy device-seconds (a core with any node on it) over 2 x the makespan.
The simulator's prediction of each arrangement comes from `dry_run` (the costs profiled in this process).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SPLIT = {"lm": "reference", "flow": "reference"}
SPLIT_SIMULATED = {"lm": "verl-sync", "flow": "colocated"}
"""What the simulator prices for the split pool: the reference loop is not a schedule it simulates; one device running
a step's phases in turn is."""
BEST = {"lm": "verl-sync", "flow": "digen"}
ASYNC = {"lm": "streamrl", "flow": "digen+tcss"}
MULTIPLEXED = {
    "jigsaw-greedy": ("jigsaw-greedy", "auto"),
    "jigsaw": ("jigsaw", "auto"),
    "jigsaw-split": ("jigsaw", "split"),
}
"""The arrangements run as one multiplexed run: (policy, the run's `arrangement`)."""
ARRANGEMENTS = ("back-to-back", "split-pool", "async", *MULTIPLEXED)


def pipelines(steps: int, config: Path) -> dict[str, dict]:
    """The multiplex config's pipelines with the benchmark's steps, by the names a multiplexed run gives them;
    evaluation only at the end, and small."""
    from dovetail.config.load import parse_config

    multiplex = yaml.safe_load(config.read_text())
    found = {}
    for entry in multiplex["pipelines"]:
        entry = copy.deepcopy(entry)
        entry.setdefault("train", {})["steps"] = steps
        entry["eval"] = {"every": 10_000} | ({"prompts": 8} if entry["kind"] == "lm" else {"per_prompt": 1})
        entry["checkpoint"] = {"every": 10_000}
        found[parse_config(entry).pipeline_name] = entry
    return found


def multiplexed_tree(arrangement: str, configs: dict[str, dict]) -> dict:
    """The arrangement's one multiplexed run of the pipelines (`MULTIPLEXED`: its policy and `arrangement`) on the 2
    local devices, every pipeline keeping its learning rate, the run taking their steps."""
    policy, arranged = MULTIPLEXED[arrangement]
    return {
        "kind": "multiplex",
        "policy": policy,
        "arrangement": arranged,
        "train": {"steps": next(iter(configs.values()))["train"]["steps"]},
        "cluster": {"devices": 2, "device": "cpu-core"},
        "pipelines": [
            {k: v for k, v in c.items() if k != "train"} | {"train": {"lr": c["train"]["lr"]}} for c in configs.values()
        ],
    }


def run(config: dict, out: Path, overrides: list[str] = (), cores: str | None = None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [
        str(ROOT / ".venv" / "bin" / "dovetail"),
        "train",
        str(path),
        *overrides,
        "--out",
        str(out),
        "--overwrite",
    ]
    command = ["taskset", "-c", cores, *command] if cores else command
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(out / "stderr.log", "w"))


def finish(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.wait() != 0:
            raise RuntimeError(f"{process.args} failed: see {process.args[-1]}/stderr.log")


def pipeline_figures(run_dir: Path) -> dict:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ledger_file = run_dir / "ledger.json"  # a Ray run's; the reference loop migrates nothing
    ledger = json.loads(ledger_file.read_text()) if ledger_file.is_file() else {}
    return {
        "seconds": sum(m["step_s"] for m in metrics),
        "step_s": statistics.mean(m["step_s"] for m in metrics),
        "samples": sum(m["samples_per_s"] * m["step_s"] for m in metrics),
        "tokens": sum(m.get("response_tokens", 0) for m in metrics),
        "migrated": sum(row["responses"] for row in ledger.get("migrated", [])),
    }


def training_seconds(run_dir: Path) -> float:
    """From the run's first node to its last optimizer step, from its trace: the training's wall time, whether its
    pipelines ran together or in turn (jigsaw may run them back to back; the sum of one pipeline's step times
    leaves out its wait for the others)."""
    nodes = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    nodes = [e for e in nodes if e["cat"] != "switch"]
    last_commit = max(e["ts"] + e["dur"] for e in nodes if e["cat"] == "commit")
    return (last_commit - min(e["ts"] for e in nodes)) / 1e6


def busy_seconds(run_dir: Path) -> float:
    """Device-seconds with at least one node running, from the run's trace: a node placed at a share of its device
    still has the whole core when nothing runs beside it, so this, not the share-weighted efficiency, is the busy
    time of a core."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for event in json.loads((run_dir / "trace.json").read_text())["traceEvents"]:
        if event["ph"] == "X" and event["cat"] != "switch":
            spans.setdefault(event["tid"], []).append((event["ts"], event["ts"] + event["dur"]))
    busy = 0.0
    for intervals in spans.values():
        end = float("-inf")
        for start, stop in sorted(intervals):
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
    return busy / 1e6


def measure(arrangement: str, configs: dict[str, dict], out: Path) -> dict:
    """Run one arrangement; returns per-pipeline figures and the makespan."""
    if arrangement in MULTIPLEXED:
        finish([run(multiplexed_tree(arrangement, configs), out)])
        figures = {name: pipeline_figures(out / name) for name in configs}
        makespan = training_seconds(out)
        return {"pipelines": figures, "makespan": makespan, "efficiency": busy_seconds(out) / (2 * makespan)}
    policies = {"async": ASYNC, "back-to-back": BEST}.get(arrangement, SPLIT)
    figures = {}
    if arrangement == "split-pool":
        processes = [
            run(c | {"policy": policies[c["kind"]]}, out / name, ["cluster.devices=1"], cores=str(core))
            for core, (name, c) in enumerate(configs.items())
        ]
        finish(processes)
    for name, config in configs.items():
        if arrangement != "split-pool":
            finish([run(config | {"policy": policies[config["kind"]]}, out / name)])
        figures[name] = pipeline_figures(out / name)
    seconds = [f["seconds"] for f in figures.values()]
    makespan = max(seconds) if arrangement == "split-pool" else sum(seconds)
    if arrangement == "split-pool":  # one process on its core from its first step to its last: busy throughout
        busy = sum(seconds)
    else:
        busy = sum(busy_seconds(out / name) for name in configs)
    return {"pipelines": figures, "makespan": makespan, "efficiency": busy / (2 * makespan)}


def predicted(arrangement: str, configs: dict[str, dict], steps: int) -> float:
    """The simulator's aggregate samples/s for the arrangement (costs profiled in this process)."""
    from dovetail.config.load import parse_config
    from dovetail.runtime.launch import dry_run

    if arrangement in MULTIPLEXED:
        return dry_run(parse_config(multiplexed_tree(arrangement, configs)), steps)["samples_per_s"]
    policies = {"async": ASYNC, "back-to-back": BEST}.get(arrangement, SPLIT_SIMULATED)
    devices = 1 if arrangement == "split-pool" else 2
    plans = [
        dry_run(parse_config(c | {"policy": policies[c["kind"]], "cluster": {"devices": devices}}), steps)
        for c in configs.values()
    ]
    samples = [p["samples_per_s"] * p["step_time_s"] * steps for p in plans]
    seconds = [p["step_time_s"] * steps for p in plans]
    return sum(samples) / (max(seconds) if arrangement == "split-pool" else sum(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "multiplex.yaml", help="a multiplex config")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-multiplex")
    parser.add_argument("--arrangements", nargs="*", default=list(ARRANGEMENTS))
    args = parser.parse_args()
    configs = pipelines(args.steps, args.config)
    results: dict[str, list[dict]] = {a: [] for a in args.arrangements}
    started = time.time()
    for repeat in range(args.repeats):
        for arrangement in args.arrangements:  # interleaved: the machine's drift hits every arrangement alike
            results[arrangement].append(measure(arrangement, configs, args.out / f"{arrangement}-{repeat}"))
            print(f"[{time.time() - started:6.0f}s] {arrangement} #{repeat}: {results[arrangement][-1]}", flush=True)
    predictions = {a: predicted(a, configs, args.steps) for a in args.arrangements}
    report(results, predictions, configs)
    (args.out / "results.json").write_text(json.dumps({"results": results, "predicted": predictions}, indent=1))


def report(results: dict[str, list[dict]], predictions: dict[str, float], configs: dict) -> None:
    def spread(values: list[float], digits: int = 1) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"

    alone = (
        {
            name: statistics.median(r["pipelines"][name]["step_s"] for r in results.get("back-to-back", []))
            for name in configs
        }
        if "back-to-back" in results
        else None
    )
    print(
        "| arrangement | makespan s | samples/s | LM tokens/s | "
        + " | ".join(f"{n} step vs alone" for n in configs)
        + " | efficiency | migrated | simulator samples/s |"
    )
    print("|---" * (7 + len(configs)) + "|")
    for arrangement, runs in results.items():
        samples = [sum(p["samples"] for p in r["pipelines"].values()) / r["makespan"] for r in runs]
        tokens = [sum(r["pipelines"][n]["tokens"] for n in configs) / r["makespan"] for r in runs]
        relative = [
            spread([r["pipelines"][n]["step_s"] / alone[n] for r in runs], 2) if alone else "—" for n in configs
        ]
        migrated = statistics.median(sum(p["migrated"] for p in r["pipelines"].values()) for r in runs)
        print(
            f"| {arrangement} | {spread([r['makespan'] for r in runs])} | {spread(samples)} | {spread(tokens, 0)} | "
            + " | ".join(relative)
            + f" | {spread([r['efficiency'] for r in runs], 2)} | {migrated:g} | {predictions[arrangement]:.1f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
