"""Where a run reports besides its run directory: `logger: [console, tensorboard, wandb, mlflow]`.

Every tracker gets the same thing from `StepLog`: each step's scalars (the numbers of its metrics.jsonl line, the
step as the tracker's step), and at every evaluation (the base one at step 0 included) its scores and what it
produced — the flow model's eval grid image, or a language model's held-out prompts and completions as a table.

* console: the progress display (`Progress`); a bar per pipeline on a terminal, one line per step elsewhere;
* tensorboard: event files in RUN/tensorboard/ (`tensorboard --logdir RUN/tensorboard`);
* wandb: a run in RUN/wandb/, offline unless WANDB_MODE says otherwise (`wandb sync RUN/wandb/offline-run-*`
  uploads it later); WANDB_PROJECT names the project (default dovetail);
* mlflow: a run in the file store RUN/mlruns/ unless MLFLOW_TRACKING_URI names another store
  (`mlflow ui --backend-store-uri RUN/mlruns`); MLFLOW_EXPERIMENT_NAME names the experiment (default dovetail).

A tracker whose package is missing is found before any work (`check_installed`): one line naming what to install.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""Tracker -> (module it imports, package to install)."""


class TrackerMissing(ValueError):
    """A tracker named in `logger` whose package is not installed; the message says what to install."""


def check_installed(loggers: list[str]) -> None:
    """Every tracker of `loggers` can be imported (console always can)."""
    for name in loggers:
        if name in PACKAGES:
            module, package = PACKAGES[name]
            try:
                importlib.import_module(module)
            except ImportError:
                raise TrackerMissing(
                    f"logger: {name} needs the {package} package: `pip install {package}`, or remove {name} from logger"
                ) from None


def scalars(metrics: dict) -> dict[str, float]:
    """The numbers of a metrics line, without its step: what every tracker logs."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of a pipeline: its scores (`total` the eval reward) and what it produced."""

    step: int
    scores: dict[str, float]
    image: Path | None = None
    """The eval grid (flow models)."""
    samples: list[tuple[str, str]] = field(default_factory=list)
    """(prompt, completion) of each held-out prompt (language models)."""

    @property
    def caption(self) -> str:
        return f"step {self.step}: eval reward {self.scores['total']:.4f}"

    def table(self) -> str:
        """The samples as a Markdown table."""
        rows = [f"| {_cell(prompt)} | {_cell(completion)} |" for prompt, completion in self.samples]
        return "\n".join([f"{self.caption}\n", "| prompt | completion |", "|---|---|", *rows])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


class Tracker:
    """What a tracking service receives; each method does nothing unless the service overrides it."""

    def log(self, step: int, values: dict[str, float]) -> None:
        """The step's scalars."""

    def log_evaluation(self, evaluation: Evaluation) -> None:
        """An evaluation's image or samples (its scores arrive through `log` with the step's scalars)."""

    def close(self, failed: bool = False) -> None:
        """End the tracker's run: finished, or failed when the run stopped on an error."""


class TensorBoard(Tracker):
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_evaluation(self, evaluation: Evaluation) -> None:
        if evaluation.image is not None:
            self.writer.add_image("eval/grid", _pixels(evaluation.image), evaluation.step, dataformats="HWC")
        if evaluation.samples:
            self.writer.add_text("eval/samples", evaluation.table(), evaluation.step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class Wandb(Tracker):
    def __init__(self, directory: Path, name: str, config: dict) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=None if "WANDB_PROJECT" in os.environ else "dovetail",
            name=name,
            dir=str(directory),
            config=config,
            mode=None if "WANDB_MODE" in os.environ else "offline",
            reinit="create_new",  # a multiplexed run has one wandb run per pipeline
            settings=wandb.Settings(console="off", silent=True, disable_git=True),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_evaluation(self, evaluation: Evaluation) -> None:
        media: dict[str, object] = {}  # wandb media by key: an Image, a Table
        if evaluation.image is not None:
            media["eval/grid"] = self.wandb.Image(str(evaluation.image), caption=evaluation.caption)
        if evaluation.samples:
            media["eval/samples"] = self.wandb.Table(
                columns=["prompt", "completion"], data=[list(s) for s in evaluation.samples]
            )
        if media:
            self.run.log(media, step=evaluation.step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflow(Tracker):
    def __init__(self, directory: Path, name: str, config: dict) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:  # MLflow 3 keeps its file store for those who opt in; a run's own store is what we want
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (directory / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "dovetail")
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def log_evaluation(self, evaluation: Evaluation) -> None:
        if evaluation.image is not None:
            self.client.log_image(self.run_id, _pixels(evaluation.image), key="eval_grid", step=evaluation.step)
        if evaluation.samples:
            self.client.log_text(self.run_id, evaluation.table(), f"eval/step_{evaluation.step:06d}.md")

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _pixels(path: Path):
    """An image file as an RGB uint8 array (height, width, 3)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def open_trackers(loggers: list[str], directory: Path, name: str, config: dict) -> list[Tracker]:
    """The trackers of `loggers` but console (the progress display), each writing under the run directory."""
    makers = {
        "tensorboard": lambda: TensorBoard(directory),
        "wandb": lambda: Wandb(directory, name, config),
        "mlflow": lambda: MLflow(directory, name, config),
    }
    return [makers[logger]() for logger in dict.fromkeys(loggers) if logger in makers]


class RunProgress:
    """The console tracker: what start-up is doing, then each step's reward, the latest eval reward and its step,
    the run's samples/s so far and the ETA.

    On a terminal, a bar per pipeline (rich) that also says what start-up is doing; otherwise (nohup, SLURM, a pipe)
    one plain line per step, flushed, so a log file shows where a run is. Disabled (logger without console):
    nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.stream = sys.stdout
        self.bar = None
        if enabled and self.stream.isatty():
            self.bar = Progress(  # fits 80 columns: a step's figures, or what start-up is doing, in one field
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=12),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[status]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
        self.tasks: dict[str, TaskID] = {}
        self.clock: dict[str, tuple[float, int]] = {}
        """Pipeline -> (time, step) when its first step of this session was recorded: the pace for the ETA."""

    def __enter__(self) -> RunProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def add(self, pipeline: str, total: int) -> None:
        if self.bar is not None:
            self.tasks[pipeline] = self.bar.add_task(pipeline, total=total, status="")

    def phase(self, pipeline: str, what: str) -> None:
        """What start-up is doing now for `pipeline`, on the bar. Plain output has step lines only: a start-up that
        fails on bad input (a broken checkpoint) then leaves its one-line error alone."""
        if self.bar is not None:
            self.bar.update(self.tasks[pipeline], status=what)

    def note(self, text: str) -> None:
        """A line that stays above the bars (or among the step lines): a decision the run made, e.g. the policy
        `policy=auto` chose."""
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.enabled:
            self._line(text)

    def step(
        self, pipeline: str, done: int, total: int, metrics: dict, last_eval: tuple[int, float], pace: float
    ) -> None:
        """Step `done`'s train reward, the latest evaluation (`last_eval`: its step and reward) and the samples per
        wall second of the run's steps so far (`pace`, summary.json's samples_per_s)."""
        now = time.monotonic()
        first_time, first_step = self.clock.setdefault(pipeline, (now - metrics.get("step_s", 0.0), done - 1))
        eta = (total - done) * (now - first_time) / max(1, done - first_step)
        if self.bar is not None:
            self.bar.update(self.tasks[pipeline], completed=done, status=_figures(metrics, last_eval, pace))
        elif self.enabled:
            self._line(f"{pipeline} step {done}/{total} {_figures(metrics, last_eval, pace)} ETA {_clock(eta)}")

    def start_at(self, pipeline: str, done: int) -> None:
        """A pipeline whose run starts (or resumes) after step `done`."""
        if self.bar is not None:
            self.bar.update(self.tasks[pipeline], completed=done)

    def _line(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=self.stream, flush=True)


def _figures(metrics: dict, last_eval: tuple[int, float], pace: float) -> str:
    """`eval@N`: the evaluation of step N, the latest (0: the base model's), however many steps ago it ran."""
    step, reward = last_eval
    return f"reward {metrics['reward/total']:.3f} eval@{step} {reward:.3f} {pace:.1f} samples/s"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
