"""Start-up as a user meets it: `dovetail train` from the shell until its first step starts, the one-process
reference beside the runtime's policies, the start-up cache warm and cold.

    .venv/bin/python benchmarks/startup.py [--repeats 3] [--out /tmp/bench-startup] [-- ARGS]

ARGS go to every `dovetail train` (on the GPU check's machine: `-- --devices 1 cluster.device=H200`); each run is
`dovetail.cli` under this script's own interpreter, so it runs wherever the package imports, with or without a venv.

Each run is a fresh `dovetail train CONFIG --steps 1` process (evaluation and checkpoints only where the run must:
the base evaluation and the last step's). Per config, the arrangements run in turn, `--repeats` rounds of them, so
the machine's drift falls on all alike. Figures:
  start-up   the summary's `startup_s`: from the command's start (after the interpreter and the CLI's own imports)
             to the first step's start: imports, Ray, the device workers, the start-up profile, the base evaluation
  launch     from this script launching the process to the command's start (the interpreter, typer)
  wall       from launch to the process's exit (the one step, its checkpoint and Ray's shutdown included)
  CPU-s      the CPU seconds (user + system, from /proc/PID/stat every 0.1 s) the run's processes spent from launch to
             the first step's start, by process: the command itself, Ray's worker processes (the device workers),
             Ray's own servers and agents; beside it the CPU-seconds the machine's cores offered in that time
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
DOVETAIL = [sys.executable, "-c", "from dovetail.cli import main; main()"]
"""The `dovetail` command, under this interpreter."""
CONFIGS = {"configs/sort.yaml": ("reference", "verl-sync"), "configs/digits.yaml": ("reference", "digen")}


RAY_SERVERS = ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "reaper")
"""Words in the command lines of Ray's own processes (its GCS, raylet, dashboard and agents, monitors)."""


def process_group(pid: int, command_pid: int) -> str:
    """Which part of a run a process of its session is: the command, a Ray worker process, one of Ray's servers."""
    if pid == command_pid:
        return "command"
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "default_worker" in line or line.startswith("ray::"):
        return "workers"
    return "Ray" if any(word in line for word in RAY_SERVERS) else "other"


def session_cpu(session: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of every live process in the session `session`."""
    seconds = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command's name: state, ppid, pgrp, session, ...
        if int(fields[3]) == session:
            seconds[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def run_once(config: str, policy: str, cache: Path, out: Path, launch: float, extra: list[str]) -> dict:
    """One `dovetail train` process in a session of its own (Ray's processes stay in it); its start-up, wall, and
    the CPU seconds of each part of it until the first step starts (`launch`: seconds from launch to the command's
    start, which the summary's start-up does not count; `extra`: more arguments of the command)."""
    command = [*DOVETAIL, "train", config, "--steps", "1", "--out", str(out), "--overwrite", *extra]
    command += [f"policy={policy}", "eval.every=1000", "checkpoint.every=1000"]
    env = os.environ | {"DOVETAIL_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    launched = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    samples: list[tuple[float, dict[int, float]]] = []
    groups: dict[int, str] = {}
    while process.poll() is None:
        seconds = session_cpu(process.pid)
        samples.append((time.perf_counter() - launched, seconds))
        for pid in seconds.keys() - groups.keys():  # named at first sight, before Ray renames its workers
            groups[pid] = process_group(pid, process.pid)
        time.sleep(0.1)
    wall = time.perf_counter() - launched
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {process.stderr.read().decode()[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    first_step = launch + summary["startup_s"]
    before = [seconds for at, seconds in samples if at <= first_step][-1]
    cpu = {group: 0.0 for group in ("command", "workers", "Ray")}
    for pid, seconds in before.items():
        if groups[pid] in cpu:
            cpu[groups[pid]] += seconds
    return {
        "startup_s": summary["startup_s"],
        "wall_s": wall,
        "offered_cpu_s": first_step * len(os.sched_getaffinity(0)),
    } | {f"cpu_{group}_s": seconds for group, seconds in cpu.items()}


def launch_overhead() -> float:
    """Seconds from launching `dovetail` to its command's start: the interpreter and the CLI module's imports."""
    start = time.perf_counter()
    subprocess.run([*DOVETAIL, "train", "--help"], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="after --: more arguments of every `dovetail train`")
    args = parser.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="bench-startup-"))
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[tuple[str, str, str], list[dict]] = {}
    overheads = []
    for round_ in range(args.repeats):
        overheads.append(launch_overhead())
        launch = statistics.median(overheads)
        for config, policies in CONFIGS.items():
            caches = {policy: Path(tempfile.mkdtemp(prefix="cache-", dir=args.out)) for policy in policies}
            for warmth in ("cold", "warm"):  # a cold run fills its empty cache, which the warm one then reads
                for policy in policies:
                    out = args.out / f"{Path(config).stem}-{policy}-{warmth}"
                    result = run_once(config, policy, caches[policy], out, launch, args.extra)
                    rows.setdefault((config, policy, warmth), []).append(result)
                    print(f"round {round_} {config} {policy} {warmth}: {result}", file=sys.stderr, flush=True)
    launch = statistics.median(overheads)
    print(f"Launch to the command's start (`dovetail train --help`): {launch:.2f} s (median of {len(overheads)})\n")
    print(
        "| config | policy | cache | start-up s (median, range) | vs reference | wall s | CPU-s to step 1: command / "
        "workers / Ray (sum) | CPU-s the cores offered |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (config, policy, warmth), results in rows.items():
        startup = [r["startup_s"] for r in results]
        reference = statistics.median(r["startup_s"] for r in rows[(config, "reference", warmth)])
        median = statistics.median(startup)
        cpu = {
            group: statistics.median(r[f"cpu_{group}_s"] for r in results) for group in ("command", "workers", "Ray")
        }
        print(
            f"| {config} | {policy} | {warmth} | {median:.1f} ({min(startup):.1f}-{max(startup):.1f}) | "
            f"{median - reference:+.1f} s | {statistics.median(r['wall_s'] for r in results):.1f} | "
            f"{cpu['command']:.1f} / {cpu['workers']:.1f} / {cpu['Ray']:.1f} ({sum(cpu.values()):.1f}) | "
            f"{statistics.median(r['offered_cpu_s'] for r in results):.1f} |"
        )


if __name__ == "__main__":
    main()
