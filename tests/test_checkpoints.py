"""Checkpoints are never lost or silently wrong: each damage done to the newest checkpoint of a run (the 13 of issue
11, and the same damage sealed into a fresh manifest, as a buggy writer would leave it) makes `--resume RUN_DIR`
fall back to the newest intact checkpoint saying so, and `--resume` of the damaged one a one-line error naming the
file; nothing newer is ever overwritten, and a resumed run keeps its history and ends bitwise where an
uninterrupted one does. All on `policy: reference`, in this process."""

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from running import train
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.load import load_config
from dovetail.models.t2i import load_model
from dovetail.rewards import RewardError
from dovetail.run_dir import BrokenCheckpoint, NothingToTrain, RunDir, RunDirInUse, load_checkpoint, seal

pytestmark = pytest.mark.slow

FLOW = [
    "policy=reference",
    "algo.prompts_per_step=2",
    "algo.group_size=2",
    "sampling.num_steps=4",
    "eval.per_prompt=1",
    "eval.every=100",
    "checkpoint.every=1",
]
LM = ["kind=lm", "task=sort", *FLOW[:3], "eval.prompts=4", *FLOW[-2:]]
STEPS = 3


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A 3-step run with a checkpoint at every step, never touched: each test damages a copy of it."""
    out = tmp_path_factory.mktemp("pristine") / "run"
    train(load_config(None, FLOW), out, steps=STEPS)
    return out


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "run"))


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(step_dir(run_dir, step) / "model.safetensors")


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def snapshot(directory: Path) -> dict[str, str]:
    """Every path under `directory` and a digest of its content: what "nothing changed" compares."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(directory.rglob("*"))
    }


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Damage done to a checkpoint directory, as the issue measured it.


def truncate(name):
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[: (d / name).stat().st_size // 2])


def random_bytes(name):
    return lambda d: (d / name).write_bytes(os.urandom((d / name).stat().st_size))


def garbage(name):
    return lambda d: (d / name).write_text("{not json at all")


def edit_json(name, **fields):
    return lambda d: (d / name).write_text(json.dumps(json.loads((d / name).read_text()) | fields))


def delete(name):
    return lambda d: (d / name).unlink()


def edit_weights(change):
    """`change(tensors)` edits the weights in place and saves them where they were."""

    def damage(d):
        tensors = load_file(d / "model.safetensors")
        change(tensors)
        save_file(tensors, d / "model.safetensors")

    return damage


def set_64_weights(value):
    def change(tensors):
        name = max(tensors, key=lambda k: tensors[k].numel())
        tensors[name].view(-1)[:64] = value

    return edit_weights(change)


def drop_a_tensor(tensors):
    tensors.pop(sorted(tensors)[0])


CHECKSUM = r"checksum mismatch \(changed after it was saved\)"
CHANGED = r"(checksum mismatch \(changed after it was saved\)|has \d+ bytes, manifest\.json says \d+)"
# (id, damage, reason the broken checkpoint is refused for)
DAMAGE = [
    ("truncated-model", truncate("model.safetensors"), r"model\.safetensors has \d+ bytes, manifest\.json says \d+"),
    ("random-model", random_bytes("model.safetensors"), r"model\.safetensors " + CHECKSUM),
    ("truncated-optimizer", truncate("optimizer.pt"), r"optimizer\.pt has \d+ bytes"),
    ("garbage-state", garbage("state.json"), r"state\.json " + CHANGED),
    ("garbage-config", garbage("config.json"), r"config\.json " + CHANGED),
    ("another-head-dim", edit_json("config.json", head_dim=16), r"config\.json " + CHANGED),
    ("step-minus-3", edit_json("state.json", step=-3), r"state\.json " + CHANGED),
    ("step-not-matching", edit_json("state.json", step=2), r"state\.json " + CHANGED),
    ("missing-manifest", delete("manifest.json"), "manifest.json missing"),
    ("64-weights-1e3", set_64_weights(1e3), r"model\.safetensors " + CHECKSUM),
    ("nan-weights", set_64_weights(float("nan")), r"model\.safetensors " + CHECKSUM),
    ("missing-file", delete("rng.pt"), "rng.pt missing"),
]
# The same damage sealed into a new manifest: what the checks behind the checksums must still catch.
SEALED_DAMAGE = [
    ("sealed-truncated-model", truncate("model.safetensors"), r"cannot load \S*step_000003/model\.safetensors"),
    ("sealed-random-model", random_bytes("model.safetensors"), r"cannot load \S*step_000003/model\.safetensors"),
    ("sealed-truncated-optimizer", truncate("optimizer.pt"), "optimizer.pt unreadable: "),
    ("sealed-garbage-state", garbage("state.json"), "state.json unreadable: "),
    ("sealed-garbage-config", garbage("config.json"), r"unreadable \S*step_000003/config\.json"),
    (
        "sealed-another-head-dim",
        edit_json("config.json", head_dim=16),
        r"cannot load \S*step_000003/model\.safetensors into the model \S*step_000003/config\.json describes: .*size",
    ),
    ("sealed-a-missing-tensor", edit_weights(drop_a_tensor), r"cannot load .*Missing key"),
    ("sealed-step-minus-3", edit_json("state.json", step=-3), "state.json step -3 is not a non-negative integer"),
    ("sealed-step-not-matching", edit_json("state.json", step=2), "state.json says step 2, the directory"),
    ("sealed-nan-weights", set_64_weights(float("nan")), r"model\.safetensors holds NaN or infinite weights"),
    ("sealed-missing-file", delete("rng.pt"), "manifest.json does not list rng.pt"),
    ("sealed-no-base-eval", edit_json("state.json", base_eval=None), "state.json has no base_eval"),
]
CASES = [
    *[pytest.param(damage, False, reason, 3, id=name) for name, damage, reason in DAMAGE],
    *[pytest.param(damage, True, reason, 3, id=name) for name, damage, reason in SEALED_DAMAGE],
    pytest.param(lambda d: None, False, "manifest.json missing", 999_999, id="empty-step-999999"),
]


def damage_checkpoint(run_dir: Path, damage, sealed: bool, step: int) -> Path:
    directory = step_dir(run_dir, step)
    directory.mkdir(exist_ok=True)
    damage(directory)
    if sealed:
        seal(directory, step)
    return directory


@pytest.mark.parametrize(("damage", "sealed", "reason", "step"), CASES)
def test_resume_falls_back_to_the_newest_intact_checkpoint_and_says_why(
    damage, sealed, reason, step, pristine, run, capsys
):
    broken = damage_checkpoint(run, damage, sealed, step)
    broken_files = snapshot(broken)
    intact = 2 if step == STEPS else STEPS
    if intact == STEPS:  # the newest intact checkpoint is the last step: nothing is left to train, nothing changes
        with pytest.raises(NothingToTrain, match=f"^nothing left to train: {run} is at step {STEPS}; "):
            train(load_config(None, FLOW), run, steps=STEPS, resume=run)
        summary = json.loads((run / "summary.json").read_text())
    else:
        summary = train(load_config(None, FLOW), run, steps=STEPS, resume=run)
    said = [line for line in capsys.readouterr().err.splitlines() if str(broken) in line]
    assert len(said) == 1, said
    assert f"skipped broken checkpoint {broken}: " in said[0] and f"resuming from {step_dir(run, intact)}" in said[0]
    assert re.search(reason, said[0]), said[0]
    # the resumed run re-ran what it had to and ended where the uninterrupted run did
    assert bitwise_equal(weights(run, STEPS), weights(pristine, STEPS))
    assert metric_steps(run) == [1, 2, 3]
    assert summary["base_eval_reward"] == json.loads((pristine / "summary.json").read_text())["base_eval_reward"]
    # the older checkpoints are as they were, the broken one was moved aside as it was, not overwritten
    assert all(snapshot(step_dir(run, k)) == snapshot(step_dir(pristine, k)) for k in range(1, intact + 1))
    if intact == STEPS:  # a run with nothing to train leaves even the broken checkpoint where it was
        assert snapshot(broken) == broken_files and not (run / "superseded").exists()
    else:
        (aside,) = (run / "superseded").glob(f"*/checkpoints/{broken.name}")
        assert snapshot(aside) == broken_files


@pytest.mark.parametrize(("damage", "sealed", "reason", "step"), CASES)
def test_resume_of_a_broken_checkpoint_is_one_line_naming_the_file_and_changes_nothing(
    damage, sealed, reason, step, run
):
    broken = damage_checkpoint(run, damage, sealed, step)
    before = snapshot(run)
    with pytest.raises(BrokenCheckpoint, match=reason) as raised:
        train(load_config(None, FLOW), run, steps=STEPS, resume=broken)
    message = str(raised.value)
    assert "\n" not in message and len(message) < 1000, message
    assert message.startswith(f"checkpoint {broken} is broken: ") and f"--resume {run} takes the newest" in message
    assert snapshot(run) == before


def test_the_command_line_refuses_a_broken_checkpoint_with_exit_code_2(run):
    broken = damage_checkpoint(run, random_bytes("model.safetensors"), False, STEPS)
    result = CliRunner().invoke(
        app, ["train", *FLOW, "--steps", str(STEPS), "--out", str(run), "--resume", str(broken)]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip() == result.output.strip().splitlines()[0]
    assert "model.safetensors checksum mismatch" in result.output and "Traceback" not in result.output


def test_a_run_whose_checkpoints_are_all_broken_says_so_in_one_line(run):
    for step in range(1, STEPS + 1):
        damage_checkpoint(run, delete("manifest.json"), False, step)
    with pytest.raises(BrokenCheckpoint, match=r"no intact checkpoint in .*step_000003: manifest.json missing; ") as e:
        train(load_config(None, FLOW), run, steps=STEPS, resume=run)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("crash", ["summary-kept", "summary-lost-and-a-line-cut-short"])
def test_resume_after_a_crash_keeps_each_step_once_and_the_run_base(crash, pristine, run, capsys):
    """Resume from step 2 with step 3 already done: step 3 runs again, appears once, and ends bitwise where it did
    the first time; the step 3 checkpoint already there moves aside whole rather than being overwritten."""
    if crash != "summary-kept":  # a driver killed mid-run: no summary yet, half a metrics line
        (run / "summary.json").unlink()
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"step": 4, "reward/to')
    summary = train(load_config(None, FLOW), run, steps=STEPS, resume=step_dir(run, 2))
    assert metric_steps(run) == [1, 2, 3]
    base = json.loads((pristine / "summary.json").read_text())
    assert (summary["base_eval_reward"], summary["base_eval"]) == (base["base_eval_reward"], base["base_eval"])
    assert json.loads((run / "summary.json").read_text()) == summary
    assert bitwise_equal(weights(run, STEPS), weights(pristine, STEPS))
    (aside,) = (run / "superseded").iterdir()
    assert snapshot(aside / "checkpoints/step_000003") == snapshot(step_dir(pristine, STEPS))
    assert f"moved step_000003 to {aside}" in capsys.readouterr().err


def garbage_line_for_step_1(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(["{not json at all\n", *lines[1:]]))


@pytest.mark.parametrize(
    ("damage", "kept", "dropped"),
    [
        (lambda path: path.write_bytes(os.urandom(path.stat().st_size)), [], r"\d+"),
        (garbage_line_for_step_1, [2], "1"),
    ],
    ids=["random-bytes", "a-garbage-line"],
)
def test_a_damaged_metrics_file_resumes_keeping_its_readable_steps_and_says_what_it_dropped(
    damage, kept, dropped, pristine, run, capsys
):
    """metrics.jsonl is the run's history, not its state: damaged, the run resumes from its intact checkpoint all the
    same (random bytes once stopped it with Python's "'utf-8' codec can't decode byte"), keeps the lines it can read
    and names, in one line, the file and how many it dropped."""
    damage(run / "metrics.jsonl")
    summary = train(load_config(None, FLOW), run, steps=STEPS, resume=step_dir(run, 2))
    said = [line for line in capsys.readouterr().err.splitlines() if "metrics.jsonl" in line]
    assert len(said) == 1 and re.fullmatch(
        rf"{re.escape(str(run / 'metrics.jsonl'))}: dropped {dropped} unreadable line\(s\), cut short by a crash or "
        "damaged; the steps they held are missing from the run's metrics unless the resumed run trains them again",
        said[0],
    ), said
    assert metric_steps(run) == [*kept, 3]
    assert bitwise_equal(weights(run, STEPS), weights(pristine, STEPS))
    assert summary["base_eval_reward"] == json.loads((pristine / "summary.json").read_text())["base_eval_reward"]


def test_a_fresh_run_in_an_old_run_directory_keeps_the_old_run_whole(pristine, run, capsys):
    before = snapshot(run)
    with pytest.raises(RunDirInUse, match=f"--out {run} holds another run's checkpoints .*pass --overwrite"):
        train(load_config(None, FLOW), run, steps=1)
    assert snapshot(run) == before
    train(load_config(None, FLOW), run, steps=1, overwrite=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]
    assert metric_steps(run) == [1]
    (aside,) = (run / "superseded").iterdir()
    assert snapshot(aside / "checkpoints") == snapshot(pristine / "checkpoints")
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        assert (aside / name).read_bytes() == (pristine / name).read_bytes()
    assert f"moved step_000001, step_000002, step_000003 to {aside}" in capsys.readouterr().err


def test_a_save_that_fails_midway_leaves_no_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def disk_full(directory):
        (directory / "model.safetensors").write_bytes(b"half a file")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        run.save_checkpoint(1, model, optimizer, {}, disk_full)
    assert not step_dir(tmp_path, 1).exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path, model, optimizer, load_model)


def test_a_reward_failing_mid_run_under_reference_saves_the_last_step_and_the_run_resumes(
    pristine, tmp_path, monkeypatch
):
    """faulty_reward turns NaN once the flag file exists: it appears after step 1's metrics are written, so step 2's
    reward fails; with checkpoint.every=100, nothing but the stop saves step 1."""
    flag = tmp_path / "nan-flag"
    monkeypatch.setenv("DOVETAIL_TEST_NAN_FLAG", str(flag))
    append_metrics = RunDir.append_metrics

    def flag_after_step_1(self, metrics):
        append_metrics(self, metrics)
        flag.touch()

    monkeypatch.setattr(RunDir, "append_metrics", flag_after_step_1)
    config = load_config(None, [*FLOW, "checkpoint.every=100", "reward={faulty_reward:nan_when_flagged: 1.0}"])
    out = tmp_path / "run"
    with pytest.raises(RewardError) as raised:
        train(config, out, steps=STEPS)
    message = str(raised.value)
    assert "'faulty_reward:nan_when_flagged' returned nan for sample 1" in message
    assert f"saved in {step_dir(out, 1)}" in message and f"--resume {out}`" in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]
    monkeypatch.setattr(RunDir, "append_metrics", append_metrics)
    flag.unlink()
    train(config, out, steps=STEPS, resume=out)
    assert metric_steps(out) == [1, 2, 3]
    assert bitwise_equal(weights(out, STEPS), weights(pristine, STEPS))  # the same rewards as digit_match's


@pytest.fixture(scope="module")
def lm_pristine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm") / "run"
    train(load_config(None, LM), out, steps=2)
    return out


@pytest.mark.parametrize(
    ("damage", "sealed", "reason"),
    [
        (random_bytes("model.safetensors"), False, r"model\.safetensors " + CHECKSUM),
        (
            edit_json("config.json", hidden=64),
            True,
            r"cannot load \S*step_000002/model\.safetensors into the model \S*step_000002/config\.json describes",
        ),
    ],
    ids=["random-model", "sealed-another-hidden-size"],
)
def test_a_language_model_checkpoint_is_checked_the_same_way(damage, sealed, reason, lm_pristine, tmp_path, capsys):
    run = Path(shutil.copytree(lm_pristine, tmp_path / "run"))
    broken = damage_checkpoint(run, damage, sealed, 2)
    with pytest.raises(BrokenCheckpoint, match=reason):
        train(load_config(None, LM), run, steps=2, resume=broken)
    train(load_config(None, LM), run, steps=2, resume=run)
    assert re.search(f"skipped broken checkpoint {broken}: {reason}", capsys.readouterr().err)
    assert bitwise_equal(weights(run, 2), weights(lm_pristine, 2))
    assert metric_steps(run) == [1, 2]
