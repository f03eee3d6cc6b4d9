"""A user's reward breaking mid-run inside a real `dovetail train` process, under the reference loop and on a Ray
policy's workers: it holds the GIL in C for minutes, raises SystemExit, or ends its process with os._exit. Each time
the run stops at the last step it finished, saved, and says so on stderr in one line, with no traceback (Ray's
included: a worker's failure is the reward's one line, however many workers failed), and the saved step resumes.
tests/test_config_rewards.py shows the same failures at the scoring level, tests/test_runtime_lm.py a NaN reward
stopping every Ray policy in this process."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dovetail.cli import app

pytestmark = pytest.mark.slow

NAME = "faulty_reward:fails_when_flagged"
TIMEOUT_S = 5
"""The runs' reward_timeout_s: the reward's first call, which imports it, fits well inside it on a loaded machine."""
SORT = ["kind=lm", "task=sort", "algo.prompts_per_step=4", "algo.group_size=4", "eval.prompts=8"]
SORT += ["runtime.profile_samples=4", "train.lr=1e-3", "eval.every=100", "checkpoint.every=100"]
SORT += [f"reward={{{NAME}: 1.0}}", f"reward_timeout_s={TIMEOUT_S}"]
SAYS = {
    "holds_the_gil": (
        rf"took longer than reward_timeout_s={TIMEOUT_S} s on \d+ samples and was stopped; make it faster, or raise "
        "reward_timeout_s in the config"
    ),
    "exits": r"raised SystemExit: 0 on sample 0 \(prompt '[^']*', completion '[^']*'\)",
    "ends_its_process": r"ended its process \(exit code 3\); a reward must return its scores, not exit",
}


def dovetail_train(out: Path, flag: Path, *arguments: str) -> subprocess.Popen:
    """`dovetail train` in a process of its own, its reward `faulty_reward:fails_when_flagged` (importable there and
    in its Ray workers), failing as `flag` says once it exists."""
    environment = os.environ | {
        "DOVETAIL_TEST_NAN_FLAG": str(flag),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path]),
    }
    command = [sys.executable, "-m", "dovetail.cli", "train", *SORT, *arguments, "--out", str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)


@pytest.mark.parametrize(
    ("policy", "failure"),
    [
        ("reference", "holds_the_gil"),
        ("reference", "exits"),
        ("reference", "ends_its_process"),
        # the other device's worker overran too: its error once followed, Ray's traceback and all, after the run's
        # one line (a reward ending its process takes the same way out of a worker: the reference case covers it)
        ("verl-sync", "holds_the_gil"),
    ],
)
def test_a_reward_failing_mid_run_stops_the_run_saved_in_one_line_and_the_run_resumes(
    policy, failure, tmp_path, monkeypatch
):
    out, flag = tmp_path / "run", tmp_path / "flag"
    process = dovetail_train(out, flag, f"policy={policy}", "--steps", "40")
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "step 1/40" in line:
            flag.write_text(failure)
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 1, stderr
    done = len(lines)  # a step whose rewards were scored before the flag was written may have finished too
    assert done in (1, 2), lines  # the run stopped once the reward broke, not at its 40th step
    saved = out / "checkpoints" / f"step_{done:06d}"
    assert [p.name for p in (out / "checkpoints").iterdir()] == [saved.name]  # checkpoint.every=100: the stop saved
    assert len(stderr.splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert re.fullmatch(
        rf"reward '{NAME}' {SAYS[failure]}; pipeline sort stopped, its last (completed|committed) step is saved in "
        rf"{re.escape(str(saved))}: fix the reward and resume with `dovetail train --resume {re.escape(str(out))}`",
        stderr.strip(),
    ), stderr
    flag.unlink()  # the reward fixed; the reference loop resumes a Ray policy's checkpoint as its own
    # the same command in this process: another `dovetail train` process would import torch and the model stack
    # again, seconds of CPU for each of these tests
    monkeypatch.setenv("DOVETAIL_TEST_NAN_FLAG", str(flag))
    arguments = [*SORT, "policy=reference", "--steps", str(done + 1), "--resume", str(out), "--out", str(out)]
    resumed = CliRunner().invoke(app, ["train", *arguments])
    assert resumed.exit_code == 0, resumed.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, done + 2))
