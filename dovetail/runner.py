"""Training a run: its pipelines' run directories, logs and checkpoints (`StepLog`), and the steps, by the reference
loop in this process (`policy: reference`: one process, no Ray, every step in order; each kind's step is its `local`
part, `pipelines/<kind>/local.py`) or by the Ray runtime (`runtime.driver.train_on_ray`). Every other policy must
reproduce the reference loop's parameters. It takes the run as a `request.RunRequest`, checked when built."""

import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from dovetail.config.common import ConfigError
from dovetail.config.load import dump_config, parse_config
from dovetail.config.multiplex import PipelineConfig, pipeline_configs
from dovetail.kinds import kind
from dovetail.plan.metrics import SUMMARY_NOTES
from dovetail.request import Callback, RunRequest
from dovetail.rewards import RewardError
from dovetail.run_dir import (
    NothingToTrain,
    RunDir,
    RunInterrupted,
    RunLock,
    check_resumable,
    load_checkpoint,
    plot_curves,
    resume_points,
    run_of,
)
from dovetail.runtime.driver import train_on_ray
from dovetail.trackers import Evaluation, RunProgress, Tracker, open_trackers, scalars


class StepLog:
    """What happens after every optimizer step of a pipeline, whoever ran it: metrics, evaluation, checkpoints,
    trackers, progress, callbacks; and the pipeline's summary.json when the run ends."""

    def __init__(
        self,
        run: RunDir,
        config: PipelineConfig,
        local,
        last_step: int,
        state: dict,
        progress: RunProgress,
        trackers: list[Tracker],
        callbacks: tuple[Callback, ...],
        interrupt: "Interrupt",
        draw_curves,
    ):
        """`local` is the pipeline's model in this process (`FlowLocal`, `LMLocal`): what is evaluated and saved;
        `state` the run's evaluations so far (a checkpoint's state.json, or the base evaluation of a fresh run);
        `draw_curves()` redraws the run's curves.png after an evaluation or a checkpoint."""
        self.run, self.config, self.local = run, config, local
        self.model, self.optimizer = local.model, local.optimizer
        self.last_step = last_step
        self.summary = {"base_eval_reward": state["base_eval"]["total"], "base_eval": state["base_eval"]}
        self.eval_reward = state["eval_reward"]
        self.lines = run.metrics()
        """metrics.jsonl's lines so far (a resumed run's earlier steps included), read once: curves.png draws them."""
        self.eval_step = max((m["step"] for m in self.lines if "eval_reward" in m), default=0)
        """The step of the evaluation `eval_reward` is from (0: the base one)."""
        self.recorded = self.saved = self.holds = state["step"]
        """The last step recorded, the last one saved, and the one whose weights `model` holds (the Ray driver
        fetches them only when a step needs them): Ctrl-C stops at a recorded step the model holds, saved."""
        self.samples = self.seconds = 0.0
        self.progress, self.trackers, self.callbacks = progress, trackers, callbacks
        self.interrupt = interrupt
        self.draw_curves = draw_curves

    @classmethod
    def open(
        cls,
        config: PipelineConfig,
        run: RunDir,
        resume: Path | None,
        last_step: int,
        progress: RunProgress,
        callbacks: tuple[Callback, ...],
        interrupt: "Interrupt",
        draw_curves,
    ):
        """The pipeline's model: fresh, evaluated once before its first step, or from a checkpoint, whose state.json
        holds the run's base and latest evaluations (a resumed run reports the base its run started from) and its
        config (which must allow this run's, `check_resumable`). Returns the log and the number of steps done."""
        name = config.pipeline_name
        progress.phase(name, "loading the model")
        local = kind(config.kind).load("local")(config)
        state = None if resume is None else load_checkpoint(resume, local.model, local.optimizer, local.load_weights)
        if state is not None and state["step"] >= last_step:
            raise NothingToTrain(
                f"nothing left to train: {run.path} is at step {state['step']}; raise train.steps (or --steps) to "
                "continue"
            )
        if state is not None and resume is not None:
            if "config" in state:
                check_resumable(_in_current_schema(state["config"]), config.model_dump(mode="json"), resume)
            _branch_history(run_of(resume), run)
        run.begin(None if state is None else state["step"])
        run.write_config(dump_config(config))
        trackers = open_trackers(
            [str(logger) for logger in config.logger], run.path, name, config.model_dump(mode="json")
        )
        base = None
        if state is None:
            progress.phase(name, "evaluating the base model")
            base = local.evaluate(run, "eval_base.png", 0)
            state = {"step": 0, "base_eval": base.scores, "eval_reward": base.scores["total"]}
        log = cls(run, config, local, last_step, state, progress, trackers, callbacks, interrupt, draw_curves)
        if base is not None:
            log._report_evaluation(base, {})
        progress.start_at(name, state["step"])
        return log, state["step"]

    def checkpoint(self, done: int, extra: dict | None = None) -> Path:
        """Save step `done` with the run's base and latest evaluations, which a run resumed from it reports, and
        the config that trained it, which the resumed run's must match (`check_resumable`)."""
        state = {"base_eval": self.summary["base_eval"], "eval_reward": self.eval_reward}
        state |= {"config": self.config.model_dump(mode="json")} | (extra or {})
        self.saved = done
        return self.run.save_checkpoint(done, self.model, self.optimizer, state, self.local.save_weights)

    def stop(self, done: int, error: RewardError) -> str:
        """Save step `done`, the last one completed, of a run whose reward failed; returns what to tell the user."""
        checkpoint = self.checkpoint(done)
        return (
            f"{error}; pipeline {self.config.pipeline_name} stopped, its last completed step is saved in {checkpoint}: "
            f"fix the reward and resume with `dovetail train --resume {self.run.path}`"
        )

    def trainer_state(self) -> dict:
        """The pipeline's trainer state in this process (`local`'s: weights, optimizer, a flow run's EMA)."""
        return self.local.trainer_state()

    def load_trainer_state(self, state: dict) -> None:
        """A committed trainer state (a Ray trainer's) into this process's model, optimizer and EMA."""
        self.local.load_trainer_state(state)

    def needs_weights(self, done: int) -> bool:
        """Whether step `done` evaluates or checkpoints, or may be the last before Ctrl-C stops the run (the Ray
        driver then fetches the trainer state)."""
        return self._eval_due(done) or self._save_due(done) or self.interrupt.requested is not None

    def _eval_due(self, done: int) -> bool:
        return done % self.config.eval.every == 0 or done == self.last_step

    def _save_due(self, done: int) -> bool:
        return done % self.config.checkpoint.every == 0 or done == self.last_step

    def record(self, done: int, metrics: dict, checkpoint_extra: dict | None = None) -> None:
        metrics = {"step": done} | metrics
        self.samples += metrics["samples_per_s"] * metrics["step_s"]
        self.seconds += metrics["step_s"]
        evaluation = None
        if self._eval_due(done):
            start = time.perf_counter()
            evaluation = self.local.evaluate(self.run, "eval_latest.png", done)
            self.eval_reward, self.eval_step = evaluation.scores["total"], done
            metrics |= {"eval_reward": self.eval_reward, "eval_s": time.perf_counter() - start}
            metrics |= {f"eval/{name}": value for name, value in evaluation.scores.items()}
        self.run.append_metrics(metrics)
        self.lines.append(dict(metrics))
        self.recorded = done
        if self._save_due(done):
            self.checkpoint(done, checkpoint_extra)
        if evaluation is not None or self._save_due(done):
            self.draw_curves()
        for tracker in self.trackers:
            tracker.log(done, scalars(metrics))
        for callback in self.callbacks:
            if hasattr(callback, "on_step"):
                callback.on_step(metrics, self.config.pipeline_name)
        if evaluation is not None:
            self._report_evaluation(evaluation, metrics)
        self.progress.step(
            self.config.pipeline_name, done, self.last_step, metrics, (self.eval_step, self.eval_reward), self.pace
        )

    @property
    def pace(self) -> float:
        """Samples trained per wall second of the steps so far: summary.json's `samples_per_s`, and the progress
        display's."""
        return self.samples / self.seconds if self.seconds else 0.0

    def _report_evaluation(self, evaluation: Evaluation, metrics: dict) -> None:
        """An evaluation to the trackers (the base one, at step 0, with its scores as a step's would be) and the
        callbacks."""
        if evaluation.step == 0:
            values = {"eval_reward": evaluation.scores["total"]}
            values |= {f"eval/{name}": value for name, value in evaluation.scores.items()}
            for tracker in self.trackers:
                tracker.log(0, values)
        for tracker in self.trackers:
            tracker.log_evaluation(evaluation)
        for callback in self.callbacks:
            if hasattr(callback, "on_eval"):
                callback.on_eval(evaluation, self.config.pipeline_name)

    def finish(self, extra: dict | None = None) -> dict:
        """The pipeline's summary.json: its evaluations before and after, and its throughput over its steps."""
        self.summary |= {"final_eval_reward": self.eval_reward, "steps": self.last_step, "samples_per_s": self.pace}
        self.summary |= {"notes": SUMMARY_NOTES}
        self.summary |= extra or {}
        self.run.write_summary(self.summary)
        self.close()
        return self.summary

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed)
        self.trackers = []


def _branch_history(source: Path, run: RunDir) -> None:
    """A run resumed into another --out than its own continues as a copy: the new directory starts with the source
    run's metrics.jsonl (cut back to the resumed step by `RunDir.begin`) and base evaluation grid; the source run is
    left as it was."""
    if source.resolve() == run.path.resolve() or (run.path / "metrics.jsonl").exists():
        return
    for name in ("metrics.jsonl", "eval_base.png"):
        if (source / name).is_file():
            shutil.copy2(source / name, run.path / name)


def train(request: RunRequest, *, devices_starting: Future | None = None) -> dict:
    """Train every pipeline of the run to `request.steps` under its policy; returns the summary. A multiplexed run
    keeps each pipeline in its own sub-directory of `out` (and resumes each from there).

    The request was checked when built (config, run directory, trackers); here, before any work, every pipeline's
    checkpoint loads and its first prompts fit its context (`check_checkpoint`, what the dry run checks).
    config.yaml records the config as run. Ctrl-C stops after the step in flight, saves it and raises
    `RunInterrupted` saying how to resume (SIGTERM and SIGHUP too, `STOP_SIGNALS`). The summary's `startup_s` is
    the seconds from `request.began` to the first step's start. `devices_starting`: the local Ray instance and device
    workers the caller is starting meanwhile (`ray_start.start_devices_in_background`), which the run waits for
    before it uses Ray."""
    torch.set_num_threads(1)
    config, out, last_step = request.config, request.out, request.steps
    multiplexed = request.multiplexed
    pipelines = pipeline_configs(config)
    for pipeline in pipelines.values():
        kind(pipeline.kind).load("check_checkpoint")(pipeline)
    resumes = dict(request.resumes)
    if request.resume is not None:
        resumes = resume_points({name: path for name, path in request.resumes.items() if path is not None})
    created = not out.exists()
    root = RunDir(out)
    # held for the run's life: another run on `out` is refused, naming this one
    with RunLock(out, *request.pipeline_dirs.values()):
        console = any("console" in pipeline.logger for pipeline in pipelines.values())
        logs: dict[str, StepLog] = {}

        def draw_curves() -> None:
            plot_curves(
                root.path / "curves.png",
                {name: (log.summary["base_eval_reward"], log.lines) for name, log in logs.items()},
            )

        try:
            with RunProgress(console) as progress, Interrupt() as interrupt:
                for name in pipelines:
                    progress.add(name, last_step)
                first_steps = {}
                for name, pipeline in pipelines.items():
                    run = RunDir(request.pipeline_dirs[name]) if multiplexed else root
                    logs[name], first_steps[name] = StepLog.open(
                        pipeline, run, resumes[name], last_step, progress, request.callbacks, interrupt, draw_curves
                    )
                if multiplexed:
                    root.write_config(dump_config(config))

                def after_record() -> None:
                    """Stop here, saved, once Ctrl-C was pressed and every pipeline has recorded the same step."""
                    recorded = {log.recorded for log in logs.values()}
                    if (
                        interrupt.requested is not None
                        and len(recorded) == 1
                        and all(log.holds in recorded for log in logs.values())
                    ):
                        raise RunInterrupted(_interrupted(logs, root, multiplexed), interrupt.requested)

                if config.policy == "reference":
                    (log,) = logs.values()
                    run_figures: dict[str, Any] = {"startup_s": time.perf_counter() - request.began}
                    for step in range(first_steps[log.config.pipeline_name], last_step):
                        try:
                            metrics = log.local.rl_step(step)
                        except RewardError as error:  # the step changed nothing yet: its reward comes before training
                            raise RewardError(log.stop(step, error)) from error
                        log.holds = step + 1
                        log.record(step + 1, metrics)
                        after_record()
                else:
                    run_figures = train_on_ray(request, logs, first_steps, after_record, devices_starting)
        except BaseException as error:
            for log in logs.values():
                log.close(failed=not isinstance(error, RunInterrupted))
            if created:  # a run that failed before writing anything (a checkpoint that would not load) leaves no trace
                _remove_if_empty(out)
            raise
        draw_curves()
        if not multiplexed:
            return next(iter(logs.values())).finish(run_figures)
        stopped = run_figures.get("stopped", {})
        summary = {
            "pipelines": {
                name: log.finish({"stopped": stopped[name]} if name in stopped else {}) for name, log in logs.items()
            }
        }
        summary |= run_figures
        root.write_summary(summary)
        return summary


def _remove_if_empty(directory: Path) -> None:
    """Remove `directory` and its sub-directories if none of them holds a file."""
    if directory.is_dir() and not any(p.is_file() or p.is_symlink() for p in directory.rglob("*")):
        shutil.rmtree(directory, ignore_errors=True)


def _in_current_schema(tree: dict) -> dict:
    """A checkpoint's config as this version writes it (fields added since then at their defaults), so that only
    what its run set differently counts as a difference; as saved if this version no longer reads it."""
    try:
        return parse_config(tree).model_dump(mode="json")
    except ConfigError:
        return tree


STOP_SIGNALS = {
    signal.SIGINT: "Ctrl-C",
    signal.SIGTERM: "SIGTERM",
    **({signal.SIGHUP: "SIGHUP (the terminal closed)"} if hasattr(signal, "SIGHUP") else {}),
}
"""What asks a run to stop after the step in flight: Ctrl-C; SIGTERM, which `kill`, systemd, Kubernetes, Docker
and SLURM send before they kill; and SIGHUP, which a closed terminal sends (the run's console output then goes
nowhere; run long jobs under nohup, tmux or a scheduler)."""


Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What `signal.signal` takes and returns: a function, or SIG_DFL / SIG_IGN; None where Python did not install it."""


class Interrupt:
    """A stop signal during a run (`STOP_SIGNALS`): the first asks the run to stop after the step in flight, which it
    saves; a second stops at once (KeyboardInterrupt), losing that step. Only the main thread can take signals:
    elsewhere (a run started from a thread) they keep their usual meaning. Ray replaces a driver's SIGTERM handler
    when it starts (`ray_start.start_ray` puts this one back)."""

    def __init__(self) -> None:
        self.requested: int | None = None
        """The signal that asked the run to stop, if one did."""
        self._previous: dict[int, Handler] = {}

    def __enter__(self) -> "Interrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        if signum == getattr(signal, "SIGHUP", None):  # the terminal is gone: writing to it would fail the run
            devnull = os.open(os.devnull, os.O_WRONLY)
            for stream in (sys.stdout, sys.stderr):
                os.dup2(devnull, stream.fileno())
        print(
            f"{STOP_SIGNALS[signum]}: stopping after the step in flight, which is saved (Ctrl-C again stops at once, "
            "unsaved)",
            file=sys.stderr,
            flush=True,
        )


def _interrupted(logs: dict, root: RunDir, multiplexed: bool) -> str:
    """Save every pipeline's last recorded step (unless it just was); say where, and how to go on."""
    for log in logs.values():
        if log.saved != log.recorded:
            log.checkpoint(log.recorded, {"policy": log.config.policy, "version": log.recorded})
    log = next(iter(logs.values()))
    where = root.path if multiplexed else log.run.checkpoints / f"step_{log.recorded:06d}"
    return f"interrupted: step {log.recorded} is saved in {where}; continue with `dovetail train --resume {root.path}`"
