"""What schedulers and operators do to a run's process: SIGTERM (kill, systemd, Kubernetes, Docker, SLURM) stops it
after the step in flight, saved, exit 143, as Ctrl-C does, under a Ray policy too (Ray replaces a driver's SIGTERM
handler); SIGKILL of the driver takes its local Ray processes with it; and a run already at its last step says
there is nothing left to train, before anything starts."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from dovetail.cli import app

pytestmark = pytest.mark.slow

SORT = ["kind=lm", "task=sort", "algo.prompts_per_step=4", "algo.group_size=4", "eval.prompts=8"]
SORT += ["runtime.profile_samples=4", "train.lr=1e-3", "eval.every=100", "checkpoint.every=100"]


def dovetail_train(out: Path, *overrides: str) -> subprocess.Popen:
    """`dovetail train` as a batch job runs it: a process of its own, stdout a pipe, 40 steps asked for."""
    command = [sys.executable, "-m", "dovetail.cli", "train", *overrides, "--steps", "40", "--out", str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_under_a_ray_policy_saves_the_step_in_flight_and_exits_143(tmp_path):
    out = tmp_path / "run"
    process = dovetail_train(out, *SORT, "policy=verl-sync")
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if "step 1/40" in line:
            process.send_signal(signal.SIGTERM)
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 143, stderr
    done = len(lines)
    saved = out / "checkpoints" / f"step_{done:06d}"
    assert [p.name for p in (out / "checkpoints").iterdir()] == [saved.name]  # checkpoint.every=100: the stop saved
    assert stderr.splitlines()[-1] == (
        f"interrupted: step {done} is saved in {saved}; continue with `dovetail train --resume {out}`"
    )
    assert "SIGTERM: stopping after the step in flight" in stderr and "Traceback" not in stderr


DRIVER = """
from dovetail.runtime.ray_start import start_local_ray
from dovetail.runtime.worker import DeviceWorker, form_group
start_local_ray(cpu_devices=2)
workers = [DeviceWorker.options(resources={"dovetail_device": 1}).remote(i) for i in range(2)]
form_group(workers)
print("ready", flush=True)
input()
"""
"""A local run's driver as far as the start of its first step: its own Ray instance, two device workers, their
group (met in Ray's key-value store: nothing of it on disk or on a port)."""


def test_a_killed_driver_takes_its_local_ray_processes_with_it():
    process = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    driver = psutil.Process(process.pid)
    below = driver.children(recursive=True)
    names = {p.name() for p in below}
    assert {"raylet", "gcs_server"} <= names and any("DeviceWorker" in " ".join(p.cmdline()) for p in below), names
    process.kill()
    process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in below):
        time.sleep(0.5)
    left = [f"{p.pid} {p.name()}" for p in below if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], "the driver's Ray processes outlived it"


@pytest.mark.parametrize("policy", ["reference", "verl-sync"])
def test_resuming_a_run_at_its_last_step_says_nothing_is_left_to_train(policy, tmp_path):
    out = tmp_path / "run"
    finished = CliRunner().invoke(app, ["train", *SORT, "policy=reference", "--steps", "1", "--out", str(out)])
    assert finished.exit_code == 0, finished.output
    resumed = ["--steps", "1", "--resume", str(out), "--out", str(out)]
    again = CliRunner().invoke(app, ["train", *SORT, f"policy={policy}", *resumed])
    assert again.exit_code == 2
    assert again.output.strip() == (
        f"nothing left to train: {out} is at step 1; raise train.steps (or --steps) to continue"
    )
