"""What a researcher expects around a run: progress lines off a terminal, config.yaml as run, a run directory that
refuses another run, --resume that checks the config, Ctrl-C that saves, one-line runtime errors with the traceback
kept, one documented meaning per metric name (and the Ray policies logging what reference logs), RAY_ADDRESS, and
the Python API with callbacks."""

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import dovetail
from dovetail.cli import app
from dovetail.config.common import ConfigError, ray_address
from dovetail.config.load import check_this_machine, load_config
from dovetail.pipelines.flow.local import FlowLocal
from dovetail.plan import metrics as metrics_module
from dovetail.run_dir import LOCK, RunDir, RunDirInUse, RunLock, load_checkpoint

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).parents[1] / "configs"
FAST = ["algo.prompts_per_step=4", "algo.group_size=4", "sampling.num_steps=6", "eval.per_prompt=2"]
STEP_LINE = re.compile(
    r"^\[\d\d:\d\d:\d\d\] digits step (\d+)/(\d+) reward \d\.\d{3} eval@(\d+) \d\.\d{3} ([\d.]+) samples/s "
    r"ETA \d+:\d\d:\d\d$"
)


def metric_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """`dovetail train` as a batch job would run it (stdout a pipe), sent SIGINT once its second step is logged."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    command = [sys.executable, "-m", "dovetail.cli", "train", *FAST, "eval.every=3", "checkpoint.every=100"]
    process = subprocess.Popen(
        [*command, "--steps", "40", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if "step 2/40" in line:
            process.send_signal(signal.SIGINT)
    stderr = process.stderr.read()
    process.wait(timeout=120)
    return out, process.returncode, lines, stderr


def test_off_a_terminal_each_step_is_one_line_with_reward_eval_throughput_and_eta(interrupted):
    _, _, lines, _ = interrupted
    steps = [STEP_LINE.fullmatch(line) for line in lines]
    assert all(steps), lines  # nothing but step lines on stdout
    assert [int(m[1]) for m in steps] == list(range(1, len(steps) + 1)) and {m[2] for m in steps} == {"40"}
    # the eval reward shown is the latest evaluation's, with its step (eval.every=3; 0: the base model's)
    assert [int(m[3]) for m in steps] == [int(m[1]) - int(m[1]) % 3 for m in steps]


def test_a_finished_run_says_its_rewards_throughput_and_start_up_apart(tmp_path):
    result = CliRunner().invoke(app, ["train", *FAST, "policy=reference", "--steps", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert result.output.splitlines()[-1] == (
        f"eval reward {summary['base_eval_reward']:.3f} -> {summary['final_eval_reward']:.3f} after 1 steps, "
        f"{summary['samples_per_s']:.1f} samples/s after {summary['startup_s']:.1f} s of start-up; run in {tmp_path}"
    )


def test_ctrl_c_saves_the_step_in_flight_and_says_how_to_resume(interrupted):
    out, code, lines, stderr = interrupted
    done = len(lines)
    assert code == 130 and done >= 2, (code, stderr)
    assert [m["step"] for m in metric_lines(out)] == list(range(1, done + 1))
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{done:06d}"]  # checkpoint.every=100
    assert stderr.splitlines()[-1] == (
        f"interrupted: step {done} is saved in {out / 'checkpoints' / f'step_{done:06d}'}; continue with "
        f"`dovetail train --resume {out}`"
    )
    assert "Traceback" not in stderr
    assert load_config(out / "config.yaml").train.steps == 40  # the config as run: --steps 40, not the default 200


def test_resume_refuses_a_config_that_changes_the_run_naming_each_field(interrupted):
    out, *_ = interrupted
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    changed = ["algo.clip_range=0.001", "seed=3", "train.steps=41"]  # train.steps may differ, the others not
    result = CliRunner().invoke(
        app, ["train", str(out / "config.yaml"), *changed, "--resume", str(out), "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        f"--resume {out}: the config differs from the checkpoint's in algo.clip_range (0.0001 -> 0.001), "
        "seed (0 -> 3); resume with the run's own config.yaml, or train afresh into another --out"
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_new_run_refuses_a_directory_holding_another_run(interrupted):
    out, *_ = interrupted
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = CliRunner().invoke(app, ["train", *FAST, "--steps", "1", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"--out {out} holds another run's checkpoints (newest {next((out / 'checkpoints').iterdir()).name}): "
        f"continue it with --resume {out}, give another --out, or pass --overwrite (its checkpoints move to "
        f"{out / 'superseded'})"
    ]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_with_another_kind_of_config_names_the_run_config_and_creates_nothing(interrupted, tmp_path):
    """The checkpoint is good: the config is not the run's. Said before the checkpoint is read (its weights would not
    fit, and it would be blamed), and nothing is written, not even an empty --out."""
    out, *_ = interrupted
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    elsewhere = tmp_path / "elsewhere"
    for where in ([], ["--out", str(elsewhere)]):
        result = CliRunner().invoke(app, ["train", str(CONFIGS / "sort.yaml"), "--resume", str(out), *where])
        assert result.exit_code == 2, result.output
        assert result.output.strip() == (
            f"--resume {out}: the config's kind ('lm') differs from the run's ('flow'); the run used "
            f"{out / 'config.yaml'}: resume with `dovetail train --resume {out}`, or train afresh into another --out"
        )
    assert not elsewhere.exists()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_the_run_resumes_as_the_interrupt_said_with_more_steps(interrupted):
    """The first of the module's tests on the interrupted run that change it."""
    out, _, lines, _ = interrupted
    done = len(lines)
    result = CliRunner().invoke(
        app, ["train", str(out / "config.yaml"), f"train.steps={done + 1}", "--resume", str(out), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert [m["step"] for m in metric_lines(out)] == list(range(1, done + 2))
    assert load_config(out / "config.yaml").train.steps == done + 1


def test_resume_continues_in_place_with_the_run_config_or_a_copy_elsewhere(interrupted, tmp_path, monkeypatch):
    """`--resume RUN` alone, as the interrupt message says: RUN/config.yaml, into RUN (never runs/latest). With
    another --out the continuation is a copy there, its history up to the resumed step included; RUN stays as it
    was."""
    out, _, _, _ = interrupted
    done = max(m["step"] for m in metric_lines(out))  # where the run is now (another test may have resumed it)
    monkeypatch.chdir(tmp_path)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    copy = tmp_path / "copy"
    result = CliRunner().invoke(app, ["train", "--resume", str(out), "--steps", str(done + 1), "--out", str(copy)])
    assert result.exit_code == 0, result.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [m["step"] for m in metric_lines(copy)] == list(range(1, done + 2))
    assert [p.name for p in (copy / "checkpoints").iterdir()] == [f"step_{done + 1:06d}"]
    result = CliRunner().invoke(
        app, ["train", "--resume", str(out / "checkpoints" / f"step_{done:06d}"), "--steps", str(done + 1)]
    )
    assert result.exit_code == 0, result.output
    assert f"after {done + 1} steps" in result.output and result.output.strip().endswith(f"run in {out}")
    assert [m["step"] for m in metric_lines(out)] == list(range(1, done + 2))
    assert load_config(out / "config.yaml").train.steps == done + 1
    assert not (tmp_path / "runs").exists()


def test_a_new_run_refuses_a_directory_holding_a_run_that_saved_no_checkpoint(tmp_path):
    """A run that stopped before its first save left config.yaml and metrics.jsonl: they are its own, not to be
    written over without --overwrite (which moves them to superseded/)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 7\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = CliRunner().invoke(app, ["train", *FAST, "--steps", "1", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"--out {out} holds another run's config.yaml and metrics.jsonl but no checkpoint (it stopped before its "
        f"first save): give another --out, or pass --overwrite (they move to {out / 'superseded'})"
    ]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    result = CliRunner().invoke(app, ["train", *FAST, "--steps", "1", "--out", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    (aside,) = (out / "superseded").iterdir()
    assert {p.name: p.read_bytes() for p in aside.iterdir() if p.is_file()} == {p.name: b for p, b in before.items()}
    assert [m["step"] for m in metric_lines(out)] == [1]


def live_run_refusal(out: Path, pid: int) -> re.Pattern:
    return re.compile(
        re.escape(f"--out {out} is in use by a live run (pid {pid} on {socket.gethostname()}, started ")
        + r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
        + re.escape("): let it end or stop it, or give another --out; --overwrite does not take a live run's directory")
    )


def test_a_live_runs_directory_is_refused_naming_its_pid_even_with_overwrite_and_a_killed_ones_is_not(tmp_path):
    """Two `dovetail train` on one --out: the second is refused, naming the first's process, rather than told that
    the live run "stopped before its first save" and offered --overwrite, which would move its files aside. Killed
    (no handler runs), the first leaves its .lock file but no lock: the directory is overwritten as any other."""
    out = tmp_path / "run"
    run = [*FAST, "policy=reference", "eval.every=100", "checkpoint.every=100", "--out", str(out)]
    command = [sys.executable, "-m", "dovetail.cli", "train", *run, "--steps", "1000"]
    live = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in live.stdout:
            if "step 1/1000" in line:  # it has written config.yaml and metrics.jsonl, and saved no checkpoint
                break
        config = (out / "config.yaml").read_text()
        for overwrite in ([], ["--overwrite"]):
            result = CliRunner().invoke(app, ["train", *run, "--steps", "1", *overwrite])
            assert result.exit_code == 2, result.output
            (line,) = result.output.strip().splitlines()
            assert live_run_refusal(out, live.pid).fullmatch(line), line
        assert not (out / "superseded").exists() and (out / "config.yaml").read_text() == config
    finally:
        live.kill()
        live.wait(timeout=60)
    assert json.loads((out / ".lock").read_text())["pid"] == live.pid
    result = CliRunner().invoke(app, ["train", *run, "--steps", "1", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert [m["step"] for m in metric_lines(out)] == [1] and not (out / ".lock").exists()  # let go at the end


HOLD = (
    "import sys; from dovetail.run_dir import RunLock; lock = RunLock(sys.argv[1]); print('held', flush=True); input()"
)


def test_a_run_lock_held_by_another_process_is_refused_naming_it_and_a_dead_holders_is_taken(tmp_path):
    """What `dovetail.runner.train` takes where it opens the run directory (a run that passed `checked_run_paths` an
    instant before another took the lock is refused there), and the API's refusal."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirInUse) as refused:
            RunLock(tmp_path)
        assert live_run_refusal(tmp_path, holder.pid).fullmatch(str(refused.value)), refused.value
        for overwrite in (False, True):
            with pytest.raises(RunDirInUse, match=f"pid {holder.pid} on"):
                dovetail.train({}, out=tmp_path, overrides=[*FAST, "policy=reference"], steps=1, overwrite=overwrite)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    lock = RunLock(tmp_path)
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirInUse, match=f"pid {os.getpid()} on"):  # flock is per open file: this process too
        RunLock(tmp_path)
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_a_runtime_error_is_one_line_naming_cause_and_fix_with_the_traceback_in_the_run(tmp_path, monkeypatch):
    """The disk fills while step 2 is saved: one line, exit 1, the traceback in RUN/error.log, step 1 resumable."""
    save = RunDir.save_checkpoint

    def disk_fills_at_step_2(self, step, *args, **kwargs):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.checkpoints))
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(RunDir, "save_checkpoint", disk_fills_at_step_2)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", *FAST, "checkpoint.every=1", "--steps", "3", "--out", str(out)])
    assert result.exit_code == 1, result.output
    (line,) = [line for line in result.output.splitlines() if not STEP_LINE.fullmatch(line)]
    assert line == (
        f"no space left on the device ([Errno 28] No space left on device: '{out / 'checkpoints'}'): free space, or "
        f"give an --out on another disk; resume from the last saved step with `dovetail train --resume {out}` "
        f"(traceback in {out / 'error.log'})"
    )
    log = (out / "error.log").read_text()
    assert log.startswith("Traceback") and "disk_fills_at_step_2" in log and "OSError" in log


def disk_usage(directory: Path) -> int:
    """Bytes `directory`'s files take on a tmpfs (whole pages), its directories' entries included."""
    page = 4096
    return sum(-(-p.stat().st_size // page) * page if p.is_file() else page for p in directory.rglob("*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_real_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """A tmpfs with room for the run after step 1 and half a checkpoint more: step 2's save runs out of space. One
    line with the disk advice (the traceback too finds room once the partial checkpoint is removed), exit 1, step 1
    intact and resumable, nothing partial left."""
    overrides = [*FAST, "checkpoint.every=1", "eval.every=100"]
    sizing = tmp_path / "sizing"
    assert CliRunner().invoke(app, ["train", *overrides, "--steps", "1", "--out", str(sizing)]).exit_code == 0
    checkpoint = disk_usage(sizing / "checkpoints")
    disk = tmp_path / "disk"
    disk.mkdir()
    size = disk_usage(sizing) + checkpoint // 2
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "run"
        result = CliRunner().invoke(app, ["train", *overrides, "--steps", "3", "--out", str(out)])
        assert result.exit_code == 1, result.output
        (line,) = [line for line in result.output.splitlines() if not STEP_LINE.fullmatch(line)]
        assert (
            line.startswith("no space left on the device (") and "free space, or give an --out on another disk" in line
        )
        assert f"--resume {out}`" in line
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]
        local = FlowLocal(load_config(None, overrides))
        assert (
            load_checkpoint(out, local.model, local.optimizer, local.load_weights)["step"] == 1
        )  # the manifest and every file check
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # lazy: a failed write may hold a file open


def documented_names() -> list[re.Pattern]:
    """The names of the metric table in plan/metrics.py's docstring, as patterns (`<...>`: any name; `<k>` a
    number)."""
    names = re.findall(r"^  (\S+) {2,}\S", metrics_module.__doc__, flags=re.MULTILINE)
    return [
        re.compile(
            re.escape(name)
            .replace(re.escape("<name>"), "[a-z_]+")
            .replace(re.escape("<kind>"), "[a-z]+")
            .replace(re.escape("<k>"), "[0-9]+")
        )
        for name in names
    ]


def undocumented(keys) -> list[str]:
    patterns = documented_names()
    return sorted(k for k in keys if not any(p.fullmatch(k) for p in patterns))


@pytest.mark.usefixtures("local_ray")
def test_every_metric_is_documented_and_ray_logs_what_reference_logs(tmp_path):
    from running import train

    runs = {}
    for policy in ("reference", "colocated"):
        config = load_config(None, FAST + [f"policy={policy}", "eval.every=100", "cluster.devices=2"])
        runs[policy] = (train(config, tmp_path / policy, steps=2), metric_lines(tmp_path / policy))
    (reference_summary, reference), (ray_summary, ray_lines) = runs["reference"], runs["colocated"]
    for lines, summary in ((reference, reference_summary), (ray_lines, ray_summary)):
        assert undocumented({k for line in lines for k in line} | set(summary)) == []
    for line in reference:  # what the reference path logs, the Ray policies log
        assert set(line) <= set(ray_lines[line["step"] - 1])
    assert {"grad_norm", "reward/digit_match", "generate_s", "score_s", "train_s", "commit_s"} <= set(ray_lines[0])
    for ours, theirs in zip(reference, ray_lines):  # same samples, same rewards; same math, same gradient
        assert theirs["reward/digit_match"] == pytest.approx(ours["reward/digit_match"], abs=1e-6)
        assert theirs["grad_norm"] == pytest.approx(ours["grad_norm"], rel=1e-4)
        assert theirs["timesteps"] == ours["timesteps"]
        assert all(theirs[k] > 0 for k in ("generate_s", "score_s", "train_s", "commit_s", "step_s"))
    # summary.json's samples/s is the steps' samples over their seconds, the same figure as each step's
    samples = sum(m["samples_per_s"] * m["step_s"] for m in ray_lines)
    assert ray_summary["samples_per_s"] == pytest.approx(samples / sum(m["step_s"] for m in ray_lines))
    assert "run_samples_per_s" not in ray_summary and "efficiency" not in ray_lines[0]
    # start-up is apart from the steps: the Ray run's holds its workers' start, the reference's only its own set-up
    assert 0 < reference_summary["startup_s"] < ray_summary["startup_s"]


def test_ray_address_is_read_from_the_environment_unless_the_config_names_one(monkeypatch):
    config = load_config(None, ["policy=digen", "cluster.devices=64"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(config.cluster) is None  # a local instance of its own, whatever runs on the machine
    with pytest.raises(ConfigError, match="cluster.devices=64: this machine has"):
        check_this_machine(config)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(config.cluster) == "10.0.0.1:6379"
    check_this_machine(config)  # the cluster's devices, not this machine's
    named = load_config(None, ["policy=digen", "cluster.address=ray://head:10001"])
    assert ray_address(named.cluster) == "ray://head:10001"
    monkeypatch.setenv("RAY_ADDRESS", "not an address")
    with pytest.raises(ConfigError, match=r"^RAY_ADDRESS: 'not an address' is not a Ray address: give host:port"):
        ray_address(config.cluster)


def test_start_ray_joins_the_cluster_of_ray_address(monkeypatch):
    """start_ray hands $RAY_ADDRESS to ray.init (caught there: no cluster is started); unset, it starts its own."""
    import ray

    from dovetail.runtime import ray_start

    class Joined(Exception):
        pass

    def init(**options):
        raise Joined(options)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    config = load_config(None, ["policy=digen"])
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(Joined) as joined:
        ray_start.start_ray(config)
    assert joined.value.args[0] == {"address": "10.0.0.1:6379", "namespace": ray_start.RAY_NAMESPACE}
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(Joined) as local:
        ray_start.start_ray(config)
    assert local.value.args[0]["address"] == "local"


class Recorder:
    def __init__(self):
        self.steps, self.evaluations = [], []

    def on_step(self, metrics, pipeline):
        self.steps.append((pipeline, metrics))

    def on_eval(self, evaluation, pipeline):
        self.evaluations.append((pipeline, evaluation))


def test_the_python_api_trains_a_config_dict_with_callbacks(tmp_path):
    import dovetail.runner  # noqa: F401 - importing every module leaves the package's `train` the API's function

    recorder = Recorder()
    tree = {"algo": {"prompts_per_step": 4, "group_size": 4}, "sampling": {"num_steps": 6}, "eval": {"per_prompt": 2}}
    summary = dovetail.train(tree, out=tmp_path / "api", steps=2, callbacks=[recorder], overrides=["logger=[]"])
    assert summary == json.loads((tmp_path / "api" / "summary.json").read_text())
    assert [metrics for _, metrics in recorder.steps] == metric_lines(tmp_path / "api")
    assert [(pipeline, e.step) for pipeline, e in recorder.evaluations] == [("digits", 0), ("digits", 2)]
    assert recorder.evaluations[0][1].scores["total"] == summary["base_eval_reward"]
    assert recorder.evaluations[-1][1].scores["total"] == summary["final_eval_reward"]
    assert recorder.evaluations[-1][1].image.read_bytes()[:4] == b"\x89PNG"
    assert tree == {
        "algo": {"prompts_per_step": 4, "group_size": 4},
        "sampling": {"num_steps": 6},
        "eval": {"per_prompt": 2},
    }


def test_the_python_api_resumes_in_place(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = {"algo": {"prompts_per_step": 2, "group_size": 2}, "sampling": {"num_steps": 4}, "eval": {"per_prompt": 1}}
    dovetail.train(tree, out=tmp_path / "run", steps=1, overrides=["logger=[]"])
    dovetail.train(tree, resume=tmp_path / "run", steps=2, overrides=["logger=[]"])
    assert [m["step"] for m in metric_lines(tmp_path / "run")] == [1, 2] and not (tmp_path / "runs").exists()


def test_the_python_api_simulates_a_shipped_scenario():
    result = dovetail.simulate("jigsaw-qwen3-4b-8xh100", ["verl-sync", "jigsaw"], steps=2)
    assert list(result["policies"]) == ["verl-sync", "jigsaw"]
    assert result["policies"]["verl-sync"]["speedup"] == 1.0
    assert all(row["samples_per_s"] > 0 for row in result["policies"].values())


def test_logger_console_off_prints_nothing(tmp_path):
    result = CliRunner().invoke(app, ["train", *FAST, "logger=[]", "--steps", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("eval reward ") and len(result.output.splitlines()) == 1


def test_resume_reads_an_older_checkpoint_config_with_the_fields_added_since_at_their_defaults(tmp_path):
    """A checkpoint written before `sampling.shift` existed (its state.json's config lacks it, sealed again)
    resumes: a field it never had, at its default now, is not a difference."""
    from running import train

    from dovetail.run_dir import seal

    config = load_config(None, [*FAST, "eval.every=100"])
    train(config, tmp_path, steps=1)
    checkpoint = tmp_path / "checkpoints" / "step_000001"
    state = json.loads((checkpoint / "state.json").read_text())
    del state["config"]["sampling"]["shift"]
    (checkpoint / "state.json").write_text(json.dumps(state))
    (checkpoint / "manifest.json").unlink()
    seal(checkpoint, 1)
    train(config, tmp_path, steps=2, resume=tmp_path)
    assert [m["step"] for m in metric_lines(tmp_path)] == [1, 2]


class CtrlCAfterStep:
    """Presses Ctrl-C (SIGINT to this process) once step `step` is recorded, as a user would between two steps."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, metrics, pipeline):
        if metrics["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.usefixtures("local_ray")
def test_ctrl_c_under_a_ray_policy_saves_the_committed_weights_of_its_last_step(tmp_path):
    """The Ray driver fetches the trainer state only for steps that need it (step 1 does not here): the step Ctrl-C
    stops at holds the committed weights of that step, equal to the reference path's after as many steps."""
    from running import train
    from safetensors.torch import load_file

    from dovetail.runner import RunInterrupted

    out = tmp_path / "colocated"
    config = load_config(None, [*FAST, "policy=colocated", "eval.every=100", "checkpoint.every=100"])
    with pytest.raises(RunInterrupted, match="^interrupted: step 2 is saved in ") as raised:
        train(config, out, steps=40, callbacks=[CtrlCAfterStep(1)])
    (saved,) = (out / "checkpoints").iterdir()
    assert saved.name == "step_000002" and str(saved) in str(raised.value)
    assert [m["step"] for m in metric_lines(out)] == [1, 2]
    train(load_config(None, [*FAST, "eval.every=100"]), tmp_path / "reference", steps=2)
    ours = load_file(saved / "model.safetensors")
    reference = load_file(tmp_path / "reference" / "checkpoints" / saved.name / "model.safetensors")
    assert max((ours[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5


@pytest.mark.parametrize("dataset", ["sort", "digits"])
def test_pretrain_never_replaces_a_model_without_overwrite(dataset, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["pretrain", dataset, "--out", str(mine), "--steps", "1"])
    assert result.exit_code == 2
    assert (
        result.output.strip() == f"--out {mine} already holds a model: give another --out, or --overwrite to replace it"
    )
    assert [p.name for p in mine.iterdir()] == ["config.json"] and (mine / "config.json").read_text() == "{}"
    shipped = CliRunner().invoke(app, ["pretrain", dataset, "--steps", "1"])  # the shipped base model is a model too
    assert shipped.exit_code == 2 and "--overwrite" in shipped.output


def test_ledger_json_names_every_field_of_its_rows():
    """A ledger.json row reads without the code that wrote it: each is a record keyed by field name."""
    from dovetail.graph.node import SampleId
    from dovetail.runtime.pipeline import Ledger

    sample = SampleId(3, 1, 2)
    ledger = Ledger(
        generated={sample: [(0, 3)]},
        scored={sample: 1},
        trained={(sample, 4): 1},
        migrated=[(3, 5, 1)],
        restarts=[(1.5, 1, "train")],
        reruns=[(1, "p/s3/train0")],
        went_on=[(3, 1, "lost device 1 (no node for 30 s)")],
    )
    assert json.loads(json.dumps(ledger.to_json())) == {
        "generated": [{"step": 3, "prompt": 1, "member": 2, "device": 0, "version": 3}],
        "trained": [{"step": 3, "prompt": 1, "member": 2, "unit": 4, "times": 1}],
        "migrated": [{"step": 3, "responses": 5, "device": 1}],
        "restarts": [{"time": 1.5, "device": 1, "during": "train"}],
        "reruns": [{"device": 1, "node": "p/s3/train0"}],
        "went_on": [{"step": 3, "devices": 1, "why": "lost device 1 (no node for 30 s)"}],
    }


def test_eval_per_digit_reads_as_eval_per_prompt_in_configs_and_checkpoints(tmp_path):
    """`eval.per_digit` was the field's name before prompts files: a config or a checkpoint's config.yaml that
    says so loads, and the config is written back under the name it has now."""
    from dovetail.config.load import dump_config

    old = tmp_path / "old.yaml"
    old.write_text("eval:\n  per_digit: 3\n")
    config = load_config(old)
    assert config.eval.per_prompt == 3 == load_config(None, ["eval.per_digit=3"]).eval.per_prompt
    assert yaml.safe_load(dump_config(config))["eval"] == {"every": 25, "per_prompt": 3, "seed": 10_000, "ema": None}


def test_a_local_ray_instance_keeps_token_authentication_without_printing_ray_s_notice():
    """Ray announces on every new local instance that it turned token authentication on; a dovetail run keeps it on
    (Ray records the mode in RAY_AUTH_MODE) and leaves the run's output to the run."""
    script = (
        "import os, ray\n"
        "from dovetail.runtime.ray_start import start_local_ray\n"
        "start_local_ray(cpu_devices=1)\n"
        "print('auth mode', os.environ['RAY_AUTH_MODE'])\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "auth mode token" in result.stdout
    assert "Token authentication" not in result.stdout + result.stderr, result.stderr


class CurvesWatch:
    """Whether the run directory's curves.png exists as each step is recorded."""

    def __init__(self, run: Path):
        self.run, self.seen = run, []

    def on_step(self, metrics, pipeline):
        self.seen.append(
            (run_curves := self.run / "curves.png").is_file() and run_curves.read_bytes()[:4] == b"\x89PNG"
        )


def test_a_run_draws_its_curves_as_it_evaluates_titles_its_eval_grids_and_shows_one_samples_per_s(tmp_path, capsys):
    """curves.png is drawn at the first evaluation (step 2) and kept; each eval grid's title says its step and
    reward; the progress line's samples/s is the run's so far, so the last one is summary.json's."""
    from PIL import Image

    out = tmp_path / "run"
    watch = CurvesWatch(out)
    tree = {"algo": {"prompts_per_step": 4, "group_size": 4}, "sampling": {"num_steps": 6}, "eval": {"per_prompt": 2}}
    overrides = ["eval.every=2", "checkpoint.every=100"]
    summary = dovetail.train(tree, out=out, steps=3, callbacks=[watch], overrides=overrides)
    assert watch.seen == [False, True, True] and (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    with Image.open(out / "eval_base.png") as base, Image.open(out / "eval_latest.png") as latest:
        assert base.text["Title"] == f"step 0: eval reward {summary['base_eval_reward']:.4f}"
        assert latest.text["Title"] == f"step 3: eval reward {summary['final_eval_reward']:.4f}"
    steps = [STEP_LINE.fullmatch(line) for line in capsys.readouterr().out.splitlines()]
    assert all(steps) and [int(m[3]) for m in steps] == [0, 2, 3]
    assert float(steps[-1][4]) == pytest.approx(summary["samples_per_s"], abs=0.05)


def test_the_curves_of_a_multiplexed_run_have_a_line_per_pipeline_and_evals_only_where_they_ran():
    from dovetail.run_dir import curves_figure

    sort = [{"step": s, "reward/total": 0.1 * s, "samples_per_s": 50.0} for s in (1, 2, 3)]
    sort[1] |= {"eval_reward": 0.4}
    digits = [{"step": s, "reward/total": 0.2, "samples_per_s": 20.0 + s} for s in (1, 2, 3)]
    digits[2] |= {"eval_reward": 0.6}
    train, evaluated, pace = curves_figure({"sort": (0.3, sort), "digits": (0.5, digits)}).axes
    for ax in (train, evaluated, pace):
        assert [line.get_label() for line in ax.lines] == ["sort", "digits"]
    assert [list(line.get_xydata().tolist()) for line in evaluated.lines] == [
        [[0, 0.3], [2, 0.4]],
        [[0, 0.5], [3, 0.6]],
    ]
    assert list(pace.lines[1].get_ydata()) == [21.0, 22.0, 23.0]


def test_export_help_names_both_libraries_a_run_exports_to():
    result = CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())
    for said in ("transformers model", "diffusers pipeline", "language-model run", "flow run with model.path"):
        assert said in help_text, said
