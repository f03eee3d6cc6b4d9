"""Start-up as a user meets it: `dovetail train` from the shell until its first step starts, the one-process
reference beside the runtime's policies, the start-up cache warm and cold.

    .venv/bin/python benchmarks/startup.py [--repeats 3] [--out /tmp/bench-startup]

Each run is a fresh `dovetail train CONFIG --steps 1` process (evaluation and checkpoints only where the run must:
the base evaluation and the last step's). Per config, the arrangements run in turn, `--repeats` rounds of them, so
the machine's drift falls on all alike. Figures:
  start-up   the summary's `startup_s`: from the command's start (after the interpreter and the CLI's own imports)
             to the first step's start: imports, Ray, the device workers, the start-up profile, the base evaluation
  launch     from this script launching the process to the command's start (the interpreter, typer)
  wall       from launch to the process's exit (the one step, its checkpoint and Ray's shutdown included)
`cold`: the run's start-up cache (`DOVETAIL_CACHE`) is a fresh empty directory, so the profile is measured;
`warm`: a cache the round's first run of the config filled. Prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"configs/sort.yaml": ("reference", "verl-sync"), "configs/digits.yaml": ("reference", "digen")}


def run_once(config: str, policy: str, cache: Path, out: Path) -> dict:
    """One `dovetail train` process; its start-up, launch overhead and wall in seconds."""
    command = [str(ROOT / ".venv/bin/dovetail"), "train", config, "--steps", "1", "--out", str(out), "--overwrite"]
    command += [f"policy={policy}", "eval.every=1000", "checkpoint.every=1000"]
    env = os.environ | {"DOVETAIL_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    launched = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - launched
    summary = json.loads((out / "summary.json").read_text())
    return {"startup_s": summary["startup_s"], "wall_s": wall}


def launch_overhead() -> float:
    """Seconds from launching `dovetail` to its command's start: the interpreter and the CLI module's imports."""
    start = time.perf_counter()
    subprocess.run([str(ROOT / ".venv/bin/dovetail"), "train", "--help"], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="bench-startup-"))
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[tuple[str, str, str], list[dict]] = {}
    overheads = []
    for round_ in range(args.repeats):
        overheads.append(launch_overhead())
        for config, policies in CONFIGS.items():
            caches = {policy: Path(tempfile.mkdtemp(prefix="cache-", dir=args.out)) for policy in policies}
            for warmth in ("cold", "warm"):  # a cold run fills its empty cache, which the warm one then reads
                for policy in policies:
                    out = args.out / f"{Path(config).stem}-{policy}-{warmth}"
                    result = run_once(config, policy, caches[policy], out)
                    rows.setdefault((config, policy, warmth), []).append(result)
                    print(f"round {round_} {config} {policy} {warmth}: {result}", file=sys.stderr, flush=True)
    launch = statistics.median(overheads)
    print(f"Launch to the command's start (`dovetail train --help`): {launch:.2f} s (median of {len(overheads)})\n")
    print("| config | policy | cache | start-up s (median, range) | vs reference | wall s |")
    print("|---|---|---|---|---|---|")
    for (config, policy, warmth), results in rows.items():
        startup = [r["startup_s"] for r in results]
        reference = statistics.median(r["startup_s"] for r in rows[(config, "reference", warmth)])
        median = statistics.median(startup)
        print(
            f"| {config} | {policy} | {warmth} | {median:.1f} ({min(startup):.1f}-{max(startup):.1f}) | "
            f"{median - reference:+.1f} s | {statistics.median(r['wall_s'] for r in results):.1f} |"
        )


if __name__ == "__main__":
    main()
