"""Trackers: a short reference run reports to tensorboard, wandb (offline) and mlflow (the run's file store), and
each holds the very numbers of metrics.jsonl, step by step, and an eval grid per evaluation; a tracker that is not
installed is one line naming the package, before any work."""

import json
import struct
import sys

import pytest
from running import train
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.load import load_config
from dovetail.trackers import scalars

FAST = ["algo.prompts_per_step=4", "algo.group_size=4", "sampling.num_steps=6", "eval.per_prompt=2"]
STEPS = 3


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tracked")
    config = load_config(None, FAST + ["eval.every=2", "logger=[console,tensorboard,wandb,mlflow]"])
    train(config, out, steps=STEPS)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    expected = {line["step"]: scalars(line) for line in lines}
    expected[0] = {"eval_reward": summary["base_eval_reward"]} | {
        f"eval/{name}": value for name, value in summary["base_eval"].items()
    }
    return out, expected


def by_step(pairs) -> dict[int, dict[str, float]]:
    """(step, key, value) triples as {step: {key: value}}."""
    found: dict[int, dict[str, float]] = {}
    for step, key, value in pairs:
        found.setdefault(step, {})[key] = value
    return found


def test_the_expected_scalars_cover_every_step_and_evaluation(tracked_run):
    _, expected = tracked_run
    assert sorted(expected) == [0, 1, 2, 3]
    assert {"reward/total", "grad_norm", "samples_per_s", "generate_s"} <= set(expected[1])
    assert "eval_reward" in expected[2] and "eval_reward" in expected[3] and "eval_reward" not in expected[1]


def test_tensorboard_holds_the_metrics_of_every_step(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, expected = tracked_run
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    found = by_step((e.step, tag, e.value) for tag in events.Tags()["scalars"] for e in events.Scalars(tag))
    assert found.keys() == expected.keys()
    for step, values in expected.items():
        assert found[step] == pytest.approx(values, rel=1e-6)  # event files keep float32
    images = events.Images("eval/grid")
    assert [image.step for image in images] == [0, 2, 3]
    assert all(image.encoded_image_string[:4] == b"\x89PNG" for image in images)


def wandb_records(run_file):
    """The records of a wandb transaction log (LevelDB's log format: 32 KiB blocks of CRC'd chunks after a 7-byte
    header), read without wandb's service, as wandb's own protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, chunk, records = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:  # the block's zero padding
            position += left
            continue
        chunk += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_runs_offline_and_its_history_holds_the_metrics(tracked_run):
    out, expected = tracked_run
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    history = [r.history for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    found = by_step(
        (h.step.num, "/".join(item.nested_key), json.loads(item.value_json))
        for h in history
        for item in h.item
        if not item.nested_key[0].startswith("_")
    )
    for step, values in expected.items():
        logged = {k: v for k, v in found[step].items() if not k.startswith("eval/grid")}
        assert logged == pytest.approx(values, rel=1e-12)
    captions = {step: values["eval/grid/caption"] for step, values in found.items() if "eval/grid/caption" in values}
    assert captions == {step: f"step {step}: eval reward {expected[step]['eval_reward']:.4f}" for step in (0, 2, 3)}
    grids = (run_dir / "files" / "media" / "images" / "eval").glob("grid_*.png")
    assert sorted(int(p.name.split("_")[1]) for p in grids) == [0, 2, 3]


def test_mlflow_file_store_under_the_run_holds_the_metrics(tracked_run):
    out, expected = tracked_run
    (run_dir,) = [p for p in (out / "mlruns").glob("*/*") if (p / "metrics").is_dir()]
    metric_files = [p for p in (run_dir / "metrics").rglob("*") if p.is_file()]
    found = by_step(
        (int(step), path.relative_to(run_dir / "metrics").as_posix(), float(value))
        for path in metric_files
        for _, value, step in (line.split() for line in path.read_text().splitlines())
    )
    assert found.keys() == expected.keys()
    for step, values in expected.items():
        assert found[step] == pytest.approx(values, rel=1e-12)
    assert json.loads((run_dir / "artifacts" / "config.json").read_text())["train"]["steps"] == STEPS
    assert "status: 3" in (run_dir / "meta.yaml").read_text()  # RunStatus.FINISHED
    grids = (run_dir / "artifacts" / "images").glob("eval_grid+step+*.png")
    assert sorted(int(p.name.split("+")[2]) for p in grids) == [0, 2, 3]


def test_a_tracker_that_is_not_installed_is_one_line_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails as if it were not installed
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", *FAST, "logger=[console,wandb]", "--steps", "1", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert (
        result.output.strip()
        == "logger: wandb needs the wandb package: `pip install wandb`, or remove wandb from logger"
    )
    assert not out.exists()


def test_a_language_model_run_logs_its_eval_samples_as_a_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dovetail.tasks import task

    lm = ["kind=lm", "task=sort", "algo.prompts_per_step=2", "algo.group_size=2", "eval.prompts=4"]
    train(load_config(None, [*lm, "logger=[tensorboard]"]), tmp_path, steps=1)
    (line,) = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"prefill_s", "decode_s", "score_s", "train_s", "commit_s", "grad_norm"} <= set(line)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("eval/samples/text_summary")}
    assert sorted(tables) == [0, 1]
    prompts = task("sort").prompts("eval", 10_000, 0, 4)
    for step, table in tables.items():
        rows = table.splitlines()[4:]
        assert table.startswith(f"step {step}: eval reward ") and len(rows) == 4
        assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == prompts
    assert events.Scalars("eval_reward")[-1].value == pytest.approx(line["eval_reward"], rel=1e-6)
