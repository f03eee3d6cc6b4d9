"""The front door of a run: what `dovetail train` and `dovetail.train(...)` ask for, built and checked once.

The command line and the Python API both build a `RunRequest` (`RunRequest.build`); the runner and the Ray driver
take it whole, so a value is parsed and checked in one place: the config (its file, overrides and steps applied to
the tree, validated once), the run directory (another run's checkpoints refused before anything starts), the resumed
run, the trackers a run logs to. What needs the model (its checkpoint loading, the first prompts fitting its context)
is checked by the runner, which loads it anyway."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dovetail.config.common import MAX_STEPS, ConfigError
from dovetail.config.load import apply_override, import_dirs_of, parse_config, read_config_tree
from dovetail.config.multiplex import MultiplexConfig, TrainConfig, pipeline_configs
from dovetail.run_dir import checked_run_paths, run_of
from dovetail.trackers import Evaluation, check_installed

DEFAULT_OUT = Path("runs/latest")
"""Where a run that names no directory (and resumes none) writes."""


class Callback(Protocol):
    """What the Python API's `callbacks` may have (either method, or both): each metrics.jsonl line, and each
    evaluation (the base one at step 0 included), with the pipeline's name."""

    def on_step(self, metrics: dict, pipeline: str) -> None: ...

    def on_eval(self, evaluation: Evaluation, pipeline: str) -> None: ...


@dataclass(frozen=True)
class FaultHooks:
    """The Ray runtime's fault-injection points, for tests and benchmarks: `after_start(started)` once the workers
    are configured, before the start-up profile; `after_part(executor, part)` after each train part is placed."""

    after_start: Callable[[Mapping[str, Any]], None] | None = None
    """Called with each pipeline's started workers (`recovery.Started`, by pipeline name)."""
    after_part: Callable[[Any, Any], None] | None = None
    """Called with the executor and the train part it just placed."""


@dataclass(frozen=True)
class RunRequest:
    """A run, checked: train every pipeline of `config` up to `config.train.steps` into `out`."""

    config: TrainConfig
    """The run config as validated, `train.steps` the run's last step (what config.yaml records)."""
    out: Path
    """The run directory (a multiplexed run's pipelines each in a sub-directory)."""
    pipeline_dirs: Mapping[str, Path]
    """Each pipeline's run directory (`run_dir.checked_run_paths`)."""
    resumes: Mapping[str, Path | None]
    """What each pipeline resumes from: a run directory or a checkpoint; None for a fresh start."""
    resume: Path | None = None
    overwrite: bool = False
    """Train afresh into an `out` that holds another run (its checkpoints move to out/superseded/)."""
    reprofile: bool = False
    """Measure the devices again instead of reading what a run of the same config measured here (`startup_cache`)."""
    callbacks: tuple[Callback, ...] = ()
    began: float = field(default_factory=time.perf_counter)
    """`time.perf_counter()` when the run was asked for: the summary's `startup_s` counts from here."""
    hooks: FaultHooks = FaultHooks()

    @property
    def steps(self) -> int:
        return self.config.train.steps

    @property
    def multiplexed(self) -> bool:
        return isinstance(self.config, MultiplexConfig)

    @classmethod
    def build(
        cls,
        config: TrainConfig | Mapping | Path | str | None = None,
        overrides: Sequence[str] = (),
        *,
        out: Path | str | None = None,
        steps: int | None = None,
        resume: Path | str | None = None,
        overwrite: bool = False,
        reprofile: bool = False,
        callbacks: Sequence[Callback] = (),
        began: float | None = None,
        hooks: FaultHooks = FaultHooks(),
        flag: str = "",
    ) -> RunRequest:
        """The request of a run, every part checked, or a ValueError (a `ConfigError`, `RunDirInUse`,
        `TrackerMissing`...) or FileNotFoundError (`resume`) of one line naming what is wrong and the fix.

        `config`: a YAML path (None: the defaults; with `resume`, the resumed run's config.yaml), a tree of config
        sections as the YAML holds them, or a config object; `overrides` dotted (`train.lr=1e-4`); `steps` (default
        the config's `train.steps`); `out` (default runs/latest, or with `resume` the resumed run's own directory:
        another `out` continues a copy there). `flag`: how the caller spells a parameter before its name in a message
        (the command line's "--", for `--steps`)."""
        began = time.perf_counter() if began is None else began
        resume = None if resume is None else Path(resume)
        if resume is not None and not resume.exists():
            raise FileNotFoundError(
                f"{flag}resume {resume}: no such run directory or checkpoint; give RUN_DIR or "
                "RUN_DIR/checkpoints/step_NNNNNN"
            )
        if resume is not None and config is None:
            config = run_of(resume) / "config.yaml"
            if not config.is_file():
                raise ConfigError(
                    f"{flag}resume {resume}: the run has no {config}; give the config it was trained with"
                )
        out = Path(out) if out is not None else run_of(resume) if resume is not None else DEFAULT_OUT
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{flag}out {out}: is a file; give a directory for the run")
        run_config = checked_config(config, overrides, steps, flag=flag)
        pipeline_dirs, resumes = checked_run_paths(run_config, out, resume, overwrite)
        return cls(
            config=run_config,
            out=out,
            pipeline_dirs=pipeline_dirs,
            resumes=resumes,
            resume=resume,
            overwrite=overwrite,
            reprofile=reprofile,
            callbacks=tuple(callbacks),
            began=began,
            hooks=hooks,
        )


def checked_config(
    config: TrainConfig | Mapping | Path | str | None,
    overrides: Sequence[str] = (),
    steps: int | None = None,
    *,
    flag: str = "",
) -> TrainConfig:
    """The run config from any of its forms (`RunRequest.build`'s `config`), with `overrides` and `steps` applied to
    its tree and validated once, and the trackers it logs to installed: all a dry run checks."""
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise ConfigError(f"{flag}steps {steps}: give a number from 1 to {MAX_STEPS}")
    path = None
    if config is None or isinstance(config, str | Path):
        path = None if config is None else Path(config)
        tree = read_config_tree(path)
    elif isinstance(config, Mapping):
        tree = copy.deepcopy(dict(config))
    else:
        tree = config.model_dump(mode="json")
    for override in overrides:
        apply_override(tree, override)
    if steps is not None:
        with_steps(tree, steps)
    if path is not None:
        import_dirs_of(tree, path)
    run_config = parse_config(tree)
    check_installed(sorted({name for p in pipeline_configs(run_config).values() for name in p.logger}))
    return run_config


def with_steps(tree: dict, steps: int) -> None:
    """`train.steps = steps` in a config tree, and in every pipeline entry of a multiplexed one (each is a whole
    pipeline config, which the run's steps are written into)."""
    tree.setdefault("train", {})
    if not isinstance(tree["train"], dict):
        raise ConfigError(f"train: a mapping of fields, e.g. train: {{steps: {steps}}}")
    tree["train"]["steps"] = steps
    for pipeline in tree.get("pipelines") or []:
        if isinstance(pipeline, dict) and isinstance(pipeline.get("train"), dict):
            pipeline["train"]["steps"] = steps
