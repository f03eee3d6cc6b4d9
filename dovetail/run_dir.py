"""A run directory: config.yaml, metrics.jsonl, summary.json, eval grids and checkpoints/step_{k:06d}/.

A checkpoint is what a long run cannot afford to lose, nor to trust when it should not:
* it appears whole or not at all: written into checkpoints/.partial-step_NNNNNN/, sealed by a manifest.json (its step,
  every file's size and sha256), fsynced, then renamed into place;
* resuming verifies it: the manifest, every file against it, state.json's step against the manifest's and the
  directory's, and the weights (they load into the run's model and are finite), all before the model is touched.
  `--resume RUN_DIR` takes the newest checkpoint that passes and names, on stderr, each newer one it skipped and
  why; `--resume RUN_DIR/checkpoints/step_NNNNNN` naming a broken one is a one-line error naming the file;
* a run never writes over checkpoints it did not make: one that starts at step k (a fresh run: before step 0) first
  moves every checkpoint of a later step into superseded/<time>/, beside copies of the config, metrics and summary
  they belong to, and says so on stderr. So a resumed run cannot overwrite a newer checkpoint, intact or not, and a
  fresh run in an old directory keeps the old run whole; delete superseded/ when you no longer want it;
* the run's history stays right across a resume: metrics.jsonl is cut back to the steps up to k (a re-run step
  appears once; a line it cannot read, cut short or damaged, is dropped and counted on stderr), and state.json
  carries the run's base evaluation, so the summary reports the base the run started from whatever happened to
  summary.json;
* one run at a time: a run holds a lock on its directory for its life (`RunLock`), and another run there is refused
  naming the live one, --overwrite or not; the lock dies with its process, so a crashed run leaves none behind.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np
import yaml

from dovetail.config.multiplex import MultiplexConfig, TrainConfig, pipeline_configs
from dovetail.files import one_line

if TYPE_CHECKING:  # torch is imported where a checkpoint is written or read: a run checks its directory before
    # torch is imported, while its devices start (`runtime.ray_start.start_devices_in_background`)
    import torch
from dovetail.kinds import DEFAULT_KIND

MANIFEST = "manifest.json"
SEALED = ("model.safetensors", "config.json", "optimizer.pt", "rng.pt", "state.json")  # in every checkpoint
STEP_DIR = re.compile(r"step_(\d+)")
RUN_RECORDS = ("config.yaml", "metrics.jsonl")
"""What a run writes before its first checkpoint: a directory holding one is another run's."""
NO_CHECKPOINT = "expected RUN_DIR or RUN_DIR/checkpoints/step_NNNNNN"
LOCK = ".lock"
"""The file of a run directory that a live run holds an exclusive flock on (`RunLock`), its pid and host inside."""
STRIP_FRAMES = 8
"""Frames an eval grid draws of a video: an 81-frame Wan video in full would be a strip 81 frames wide."""


class BrokenCheckpoint(ValueError):
    """A checkpoint that must not be resumed from; the message names the file and what is wrong with it."""


class RunDirInUse(ValueError):
    """A new run asked to write where another run's checkpoints are; the message says how to go on."""


class RunInterrupted(Exception):
    """A signal stopped the run after a step that is saved; the message says how to resume, `exit_code` is what a
    process killed by that signal would have returned (128 + its number: 130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class ConfigMismatch(ValueError):
    """A resumed run whose config changes what the checkpoint's run computed; the message names the fields."""


RESUMABLE_FIELDS = (
    "train.steps",
    "eval.every",
    "checkpoint.every",
    "policy",
    "priority",
    "cluster",
    "runtime",
    "logger",
    "import_dirs",
)
"""Config fields (and sections) a resumed run may change: how long it runs, how often it evaluates and saves, where
and how the work is scheduled (every policy computes the reference's parameters), what it reports to, where its
reward modules are found. Any other
field changes what a step computes, and the resumed run would not be the run its checkpoint belongs to."""


def check_run_directory(path: Path, resume: Path | None, overwrite: bool) -> None:
    """A run may write into `path`: it holds no checkpoints, or they are the run's own (it resumes from this very
    directory), or `overwrite` (the old checkpoints then move to superseded/, `RunDir.begin`). Checked before
    anything is written."""
    found = checkpoint_dirs(Path(path) / "checkpoints")
    records = [name for name in RUN_RECORDS if (Path(path) / name).is_file()]
    if overwrite or not (found or records):
        return
    if resume is not None and run_of(resume).resolve() == Path(path).resolve():
        return
    if not found:  # a run that stopped before its first save: nothing to resume, but its records are its own
        raise RunDirInUse(
            f"--out {path} holds another run's {' and '.join(records)} but no checkpoint (it stopped before its "
            f"first save): give another --out, or pass --overwrite (they move to {Path(path) / 'superseded'})"
        )
    raise RunDirInUse(
        f"--out {path} holds another run's checkpoints (newest {found[0][1].name}): continue it with --resume {path}, "
        f"give another --out, or pass --overwrite (its checkpoints move to {Path(path) / 'superseded'})"
    )


def checked_run_paths(
    config: TrainConfig, out: Path, resume: Path | None, overwrite: bool
) -> tuple[dict[str, Path], dict[str, Path | None]]:
    """Each pipeline's run directory under `out` (a multiplexed run's: a sub-directory each) and what it resumes
    from, checked before anything starts: no live run holds one (`check_not_live`, whatever `overwrite`), no
    directory holds another run's checkpoints unless `overwrite` (`check_run_directory`), and a resumed run trains
    the model its run trained (`check_same_model`)."""
    pipelines = pipeline_configs(config)
    multiplexed = isinstance(config, MultiplexConfig)
    paths = {name: out / name if multiplexed else out for name in pipelines}
    resumes = {
        name: None if resume is None else (Path(resume) / name if multiplexed else Path(resume)) for name in paths
    }
    for directory in dict.fromkeys([out, *paths.values()]):
        check_not_live(directory)
    for name, path in paths.items():
        check_run_directory(path, resumes[name], overwrite)
    if resume is not None:
        check_same_model(run_of(resume), config.model_dump(mode="json"))
        for name, pipeline in pipelines.items():
            if multiplexed:
                check_same_model(run_of(Path(resume) / name), pipeline.model_dump(mode="json"))
    return paths, resumes


def check_not_live(directory: Path) -> None:
    """No live run holds `directory`'s lock (`RunLock`): else `RunDirInUse` naming it. Asked with a shared lock,
    let go at once: a run that takes the lock at that instant retries (`RunLock`), and two checks never collide."""
    try:
        file = open(Path(directory) / LOCK)
    except (FileNotFoundError, NotADirectoryError):
        return
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirInUse(_live_run(directory, file.read())) from None


def _live_run(directory: Path, holder: str) -> str:
    """The refusal of a run on `directory`, which the live run that wrote `holder` (its lock's contents) holds."""
    try:
        held = json.loads(holder)
        who = f"pid {held['pid']} on {held['host']}, started {held['started']}"
    except (ValueError, KeyError, TypeError):  # taken an instant ago: its holder has not written itself yet
        who = "a process that took it an instant ago"
    return (
        f"--out {directory} is in use by a live run ({who}): let it end or stop it, or give another --out; "
        "--overwrite does not take a live run's directory"
    )


class RunLock:
    """An exclusive flock on each of `directories`' .lock (created where missing), held until `release` (or the
    process's end: the OS drops a dead process's locks, so a crashed run leaves no stale one and its directory resumes
    or is overwritten as any other). The file says who holds it: pid, host and start. A lock held elsewhere, by
    another process or another run of this one (flock is per open file), is `RunDirInUse` naming its holder. flock is
    advisory and, on some network file systems, local to each machine: it keeps apart the runs of one machine."""

    ATTEMPTS = 20
    """Tries 10 ms apart before a lock held counts as a live run's: a `check_not_live` may hold it for an instant."""

    def __init__(self, *directories: Path):
        self.held: list[tuple[Path, TextIO]] = []
        try:
            for directory in dict.fromkeys(Path(d) for d in directories):
                directory.mkdir(parents=True, exist_ok=True)
                self.held.append((directory / LOCK, self._take(directory)))
        except BaseException:
            self.release()
            raise

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @classmethod
    def _take(cls, directory: Path) -> TextIO:
        path = directory / LOCK
        while True:
            file = open(path, "a+")
            for _ in range(cls.ATTEMPTS):
                try:
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.01)
            else:
                file.seek(0)
                holder = file.read()
                file.close()
                raise RunDirInUse(_live_run(directory, holder))
            try:
                same = os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            file.close()  # its holder released it (and removed the file) between our open and lock: lock the new one
        file.truncate(0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n")
        file.flush()
        return file

    def release(self) -> None:
        """Let go of every lock: each file is removed while still locked (a process waiting on the old file then sees
        it gone and locks a new one), so a directory the run leaves empty can be removed."""
        for path, file in reversed(self.held):
            path.unlink(missing_ok=True)
            file.close()
        self.held = []


IDENTITY_FIELDS = ("kind", "task", "model.checkpoint", "model.path")
"""Config fields that name what a run trains: a config differing in one of them is another run's, whatever its
checkpoints hold (their weights would not even fit its model)."""


def check_same_model(run: Path, current: dict) -> None:
    """`--resume` of `run` with a config (`current`, as `model_dump(mode="json")` writes it) that trains what the run
    trained: its kind, task and model are the run's config.yaml's, or a ConfigMismatch naming the first that differs
    and the config the run used. Checked before the checkpoint is read, which would otherwise fail as if broken. A
    run without a readable config.yaml is left to the checkpoint's own checks."""
    recorded = Path(run) / "config.yaml"
    try:
        saved = yaml.safe_load(recorded.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return
    if not isinstance(saved, dict):
        return
    saved = {"kind": DEFAULT_KIND} | saved
    for field in IDENTITY_FIELDS:
        if field == "task" and _at(current, "model.path") is not None:
            continue  # a model.path run trains no task (a config.yaml of an older version records the default's)
        if _at(saved, field) != _at(current, field):
            raise ConfigMismatch(
                f"--resume {run}: the config's {field} ({_at(current, field)!r}) differs from the run's "
                f"({_at(saved, field)!r}); the run used {recorded}: resume with `dovetail train --resume {run}`, "
                "or train afresh into another --out"
            )


def check_resumable(saved: dict, current: dict, checkpoint: Path) -> None:
    """The config a checkpoint was trained with (`saved`, as its state.json holds it) against a resumed run's:
    equal but for RESUMABLE_FIELDS, or a ConfigMismatch naming every field that differs."""
    differing = [f for f in _differing_fields(saved, current) if not f.startswith(RESUMABLE_FIELDS)]
    if differing:
        shown = ", ".join(f"{f} ({_at(saved, f)!r} -> {_at(current, f)!r})" for f in differing[:5])
        more = f" and {len(differing) - 5} more" if len(differing) > 5 else ""
        raise ConfigMismatch(
            f"--resume {checkpoint}: the config differs from the checkpoint's in {shown}{more}; resume with the "
            "run's own config.yaml, or train afresh into another --out"
        )


def _differing_fields(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            f
            for key in sorted(a.keys() | b.keys())
            for f in _differing_fields(a.get(key), b.get(key), f"{prefix}{key}.")
        ]
    return [] if a == b else [prefix.rstrip(".")]


def _at(tree, dotted: str):
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


class RunDir:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"

    def begin(self, resumed_step: int | None) -> None:
        """Make way for a run that continues after `resumed_step` (None: a fresh run): checkpoints of later steps
        move to superseded/<time>/, metrics.jsonl keeps the lines of the steps up to it, summary.json goes (the run
        writes its own when it ends)."""
        later = [d for step, d in checkpoint_dirs(self.checkpoints) if resumed_step is None or step > resumed_step]
        records = [name for name in RUN_RECORDS if resumed_step is None and (self.path / name).is_file()]
        if later or records:  # records alone: a run that stopped before its first save, overwritten
            (self.path / "superseded").mkdir(exist_ok=True)
            aside = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=self.path / "superseded"))
            for name in ("config.yaml", "metrics.jsonl", "summary.json"):
                if (self.path / name).exists():
                    shutil.copy2(self.path / name, aside / name)
            (aside / "checkpoints").mkdir()
            for directory in later:
                os.replace(directory, aside / "checkpoints" / directory.name)
            names = ", ".join(sorted(d.name for d in later) or records)
            start = "a fresh run" if resumed_step is None else f"a run resumed at step {resumed_step}"
            print(
                f"{self.checkpoints if later else self.path}: moved {names} to {aside} to make way for {start}",
                file=sys.stderr,
            )
        metrics = self.path / "metrics.jsonl"
        lines = metrics.read_bytes().splitlines(keepends=True) if metrics.exists() else []
        steps = [_step_of(line) for line in lines]
        kept = [line.decode() for line, step in zip(lines, steps) if resumed_step is not None and step <= resumed_step]
        unreadable = steps.count(float("inf"))
        if unreadable and resumed_step is not None:  # what the file held is not dropped without a word
            print(
                f"{metrics}: dropped {unreadable} unreadable line(s), cut short by a crash or damaged; the steps they "
                "held are missing from the run's metrics unless the resumed run trains them again",
                file=sys.stderr,
            )
        _write_atomically(metrics, "".join(kept))
        (self.path / "summary.json").unlink(missing_ok=True)

    def write_config(self, text: str) -> None:
        (self.path / "config.yaml").write_text(text)

    def append_metrics(self, metrics: dict) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def write_summary(self, summary: dict) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))

    def metrics(self) -> list[dict]:
        """Every line of metrics.jsonl so far."""
        path = self.path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def save_eval_grid(self, images: np.ndarray, prompts: list[str], name: str, title: str) -> None:
        """`title` (the evaluation's step and reward) above, and in the PNG's Title field. One column per prompt,
        its samples down the column: tiled into one image and drawn once, because the
        driver pauses training while it draws (80 subplots took 1.6 s, this takes a tenth of that). Images are
        (B, H, W) grey, drawn dark on white, or (B, H, W, 3) RGB, drawn as they are; videos (B, F, H, W, 3) are drawn
        as frame strips: each sample's frames left to right a pixel apart, at most STRIP_FRAMES of them evenly spaced
        from the first to the last, the strips 3 pixels apart."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        pad = 1
        if images.ndim == 5:
            pad = 3
            shown = np.linspace(0, images.shape[1] - 1, min(images.shape[1], STRIP_FRAMES)).round().astype(int)
            images = images[:, shown]
            samples, frames, height, width, _ = images.shape
            spaced = np.pad(images, ((0, 0), (0, 0), (0, 0), (0, 1), (0, 0)), constant_values=1.0)
            images = spaced.transpose(0, 2, 1, 3, 4).reshape(samples, height, frames * (width + 1), 3)[:, :, :-1]
        columns = sorted(set(prompts))
        rgb = images.ndim == 4
        height, width = images.shape[1:3]
        rows = max(prompts.count(p) for p in columns)
        grid = np.ones((rows * (height + pad) + pad, len(columns) * (width + pad) + pad, *images.shape[3:]))
        filled = dict.fromkeys(columns, 0)
        for image, prompt in zip(images, prompts):
            row, column = filled[prompt], columns.index(prompt)
            filled[prompt] += 1
            top, left = pad + row * (height + pad), pad + column * (width + pad)
            grid[top : top + height, left : left + width] = image if rgb else 1 - image
        fig, ax = plt.subplots(figsize=(len(columns) * 0.8 * width / height, rows * 0.8 + 0.4))
        ax.imshow(grid, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks([pad + c * (width + pad) + width / 2 - 0.5 for c in range(len(columns))], columns, fontsize=7)
        ax.set_yticks([])
        ax.xaxis.tick_top()
        ax.set_title(title, fontsize=8)
        fig.tight_layout()
        fig.savefig(self.path / name, dpi=110, metadata={"Title": title})
        plt.close(fig)

    def save_checkpoint(
        self, step: int, model, optimizer: torch.optim.Optimizer, state: dict, save_weights: Callable[[Path], None]
    ) -> Path:
        """Write checkpoints/step_{step:06d}/ whole or not at all; `state` goes into its state.json beside the step.
        `save_weights(directory)` writes the model in its own format (the pipeline kind's: `models` knows them)."""
        final = self.checkpoints / f"step_{step:06d}"
        partial = self.checkpoints / f".partial-{final.name}"
        import torch

        shutil.rmtree(partial, ignore_errors=True)  # left by a crash in the middle of saving this step
        try:
            partial.mkdir(parents=True)
            save_weights(partial)
            torch.save(optimizer.state_dict(), partial / "optimizer.pt")
            torch.save({"torch": torch.get_rng_state()}, partial / "rng.pt")
            (partial / "state.json").write_text(json.dumps({"step": step} | state))
            seal(partial, step)
        except Exception as error:  # the earlier checkpoints stay as they were; this one leaves nothing behind
            shutil.rmtree(partial, ignore_errors=True)
            if disk_full(error) or shutil.disk_usage(self.checkpoints).free < checkpoint_bytes(model):
                raise OSError(errno.ENOSPC, f"No space left on device while saving step {step} in {final}") from error
            raise
        if final.exists():  # a step saved again: its run's reward failed right after a periodic save
            replaced = self.checkpoints / f".replaced-{final.name}"
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
            os.replace(partial, final)
            shutil.rmtree(replaced)
        else:
            os.replace(partial, final)
        _fsync(self.checkpoints)
        return final


def checkpoint_bytes(model) -> int:
    """About what a checkpoint of `model` takes: its weights and AdamW's two moments of each trained one. A save that
    failed where less is free failed for the space, whatever the writing library said (torch's zip writer reports
    a short write as "unexpected pos")."""
    return sum(p.numel() * p.element_size() * (3 if p.requires_grad else 1) for p in model.parameters())


def disk_full(error: BaseException) -> bool:
    """Whether `error` is a write that ran out of disk space, however the library that wrote said so (safetensors
    raises its own error carrying the OS's message)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(error) or "os error 28" in str(error)


class NothingToTrain(ValueError):
    """`--resume` of a run that already reached the steps asked for; checked once the checkpoint is read, before the
    run directory or the devices are touched."""


def resume_points(resumes: dict[str, Path]) -> dict[str, Path | None]:
    """The checkpoint each pipeline of a run resumes from, decided before anything starts. One pipeline: what it was
    given (`load_checkpoint` takes a run directory's newest intact checkpoint). Several (multiplexed): pipelines
    finish their steps at different times, so a run that was killed holds uneven newest steps; every pipeline resumes
    from the newest step all of them saved intact (their later checkpoints then move to superseded/,
    `RunDir.begin`), or starts afresh if they share none, said on stderr."""
    if len(resumes) == 1:
        points: dict[str, Path | None] = dict(resumes)
    else:
        saved = {
            name: {step: d for step, d in checkpoint_dirs(run_of(path) / "checkpoints") if _intact(d)}
            for name, path in resumes.items()
        }
        shared = set.intersection(*(set(steps) for steps in saved.values()))
        newest = {name: max(steps, default=0) for name, steps in saved.items()}
        common = max(shared, default=0)
        if len(set(newest.values())) > 1:
            stood = ", ".join(f"{name} at step {step}" for name, step in newest.items())
            start = (
                f"from step {common}, the newest every pipeline saved" if common else "afresh: no step is saved by all"
            )
            print(f"the pipelines stopped unevenly ({stood}); every pipeline resumes {start}", file=sys.stderr)
        points = {name: saved[name][common] if common else None for name in resumes}
    return points


def run_of(path: Path) -> Path:
    """The run directory of `--resume` given a run or one of its checkpoints."""
    path = Path(path)
    return path.parent.parent if STEP_DIR.fullmatch(path.name) else path


def _intact(directory: Path) -> bool:
    try:
        _verify(directory)
    except BrokenCheckpoint:
        return False
    return True


def checkpoint_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoints/step_N, newest first, intact or not."""
    found = [(int(m[1]), p) for p in checkpoints.glob("step_*") if (m := STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def seal(directory: Path, step: int) -> None:
    """Write a checkpoint directory's manifest.json (its step, every other file's size and sha256), everything
    fsynced: what resuming checks the checkpoint against."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync(path)
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    (directory / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=2))
    _fsync(directory / MANIFEST)
    _fsync(directory)


def load_checkpoint(path: Path | str, model, optimizer: torch.optim.Optimizer, load_weights: Callable) -> dict:
    """Restore weights, optimizer and RNG state in place from a checkpoint directory, or from the newest intact
    checkpoint of a run directory (a line on stderr for each newer one skipped); returns its state.json.
    `load_weights(directory)` reads the model of a checkpoint in its own format (the pipeline kind's)."""
    path = Path(path)
    if STEP_DIR.fullmatch(path.name):
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint at {path}: {NO_CHECKPOINT}")
        try:
            return _restore(path, model, optimizer, load_weights)
        except BrokenCheckpoint as broken:
            run = path.parent.parent
            raise BrokenCheckpoint(
                f"checkpoint {path} is broken: {broken}; resume from another one (--resume {run} takes the newest "
                "intact checkpoint)"
            ) from None
    skipped = []
    for _, directory in checkpoint_dirs(path / "checkpoints"):
        try:
            state = _restore(directory, model, optimizer, load_weights)
        except BrokenCheckpoint as broken:
            skipped.append((directory, broken))
            continue
        for broken_directory, reason in skipped:
            print(f"skipped broken checkpoint {broken_directory}: {reason}; resuming from {directory}", file=sys.stderr)
        return state
    if skipped:
        reasons = "; ".join(f"{d.name}: {reason}" for d, reason in skipped)
        raise BrokenCheckpoint(f"no intact checkpoint in {path / 'checkpoints'} ({reasons}); train afresh instead")
    raise FileNotFoundError(f"no checkpoint at {path}: {NO_CHECKPOINT}")


def _restore(directory: Path, model, optimizer: torch.optim.Optimizer, load_weights: Callable) -> dict:
    """Load one checkpoint into the model, optimizer and RNG; everything is read and checked before any of them
    changes, so a broken checkpoint (BrokenCheckpoint) leaves them as they were."""
    import torch

    state = _verify(directory)
    try:
        weights = load_weights(directory).state_dict()
    except (ValueError, FileNotFoundError) as error:  # the loaders' one-line errors name the file
        raise BrokenCheckpoint(str(error)) from None
    expected = model.state_dict()
    misfit = sorted(
        k
        for k in expected.keys() | weights.keys()
        if k not in expected or k not in weights or weights[k].shape != expected[k].shape
    )
    if misfit:
        raise BrokenCheckpoint(f"model.safetensors does not fit the run's model (tensor {misfit[0]})")
    non_finite = sorted(k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if non_finite:
        raise BrokenCheckpoint(f"model.safetensors holds NaN or infinite weights (tensor {non_finite[0]})")
    optimizer_state = _torch_load(directory / "optimizer.pt")
    rng = _torch_load(directory / "rng.pt")
    rng = rng.get("torch") if isinstance(rng, dict) else None
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise BrokenCheckpoint("rng.pt holds no torch RNG state")
    try:
        optimizer.load_state_dict(optimizer_state)  # checks its parameter groups before it changes anything
    except (ValueError, KeyError, TypeError) as error:
        raise BrokenCheckpoint(f"optimizer.pt does not fit the run's optimizer: {one_line(error)}") from None
    model.load_state_dict(weights)
    torch.set_rng_state(rng)
    return state


def _verify(directory: Path) -> dict:
    """state.json of a checkpoint whose files are the ones its manifest lists and whose steps agree."""
    named = STEP_DIR.fullmatch(directory.name)
    if named is None:
        raise BrokenCheckpoint(f"{directory.name} is not a checkpoint's name (step_NNNNNN)")
    step = int(named[1])
    manifest = _read_json(directory / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("step") != step:
        raise BrokenCheckpoint(f"{MANIFEST} is not the manifest of step {step}")
    unlisted = [name for name in SEALED if name not in files]
    if unlisted:
        raise BrokenCheckpoint(f"{MANIFEST} does not list {unlisted[0]}")
    for name, entry in files.items():
        path, entry = directory / name, entry if isinstance(entry, dict) else {}
        if not path.is_file():
            raise BrokenCheckpoint(f"{name} missing")
        if path.stat().st_size != entry.get("bytes"):
            raise BrokenCheckpoint(f"{name} has {path.stat().st_size} bytes, {MANIFEST} says {entry.get('bytes')}")
        if _sha256(path) != entry.get("sha256"):
            raise BrokenCheckpoint(f"{name} checksum mismatch (changed after it was saved)")
    state = _read_json(directory / "state.json")
    recorded = state.get("step") if isinstance(state, dict) else None
    if type(recorded) is not int or recorded < 0:
        raise BrokenCheckpoint(f"state.json step {recorded!r} is not a non-negative integer")
    if recorded != step:
        raise BrokenCheckpoint(f"state.json says step {recorded}, the directory and {MANIFEST} step {step}")
    base = state.get("base_eval")
    if not isinstance(base, dict) or not isinstance(base.get("total"), float | int):
        raise BrokenCheckpoint("state.json has no base_eval with a total")
    if not isinstance(state.get("eval_reward"), float | int):
        raise BrokenCheckpoint("state.json has no eval_reward")
    return state


def _read_json(path: Path):
    if not path.is_file():
        raise BrokenCheckpoint(f"{path.name} missing")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BrokenCheckpoint(f"{path.name} unreadable: {one_line(error)}") from None


def _torch_load(path: Path):
    import torch

    try:
        return torch.load(path, weights_only=True)
    except Exception as error:  # a damaged file raises RuntimeError, EOFError, UnpicklingError... as it happens
        raise BrokenCheckpoint(f"{path.name} unreadable: {one_line(error)}") from None


def _step_of(line: bytes) -> float:
    """The step of a metrics.jsonl line; infinite for one that is not a JSON object with an integer step (a crash
    cut it short, or the file was damaged): such a line is never kept."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
    return step if type(step) is int else float("inf")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    """Push a file, or a directory's entries, to the disk: a rename is only as durable as what it renames."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".partial-{path.name}")
    partial.write_text(text)
    _fsync(partial)
    os.replace(partial, path)


def plot_curves(path: Path, pipelines: dict[str, tuple[float, list[dict]]]) -> None:
    """curves.png (`curves_figure`). Redrawn whole from metrics.jsonl (a resumed run's earlier steps included) at
    every evaluation, checkpoint and at the end of a run, a fraction of a second each."""
    import matplotlib.pyplot as plt

    fig = curves_figure(pipelines)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curves_figure(pipelines: dict[str, tuple[float, list[dict]]]):
    """Per step, the train reward, the eval reward (at the steps that evaluated, step 0 the base evaluation) and
    the step's samples/s, a line per pipeline. `pipelines`: name -> (base eval reward, its metrics lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 7), layout="constrained")
    for name, (base, lines) in pipelines.items():
        evaluated = [(0, base)] + [(m["step"], m["eval_reward"]) for m in lines if "eval_reward" in m]
        axes[0].plot([m["step"] for m in lines], [m["reward/total"] for m in lines], label=name)
        axes[1].plot(*zip(*evaluated), marker="o", label=name)
        axes[2].plot([m["step"] for m in lines], [m["samples_per_s"] for m in lines], label=name)
    for ax, what in zip(axes, ("train reward", "eval reward", "the step's samples/s")):
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[2].set_xlabel("step")
    if len(pipelines) > 1:
        axes[0].legend(fontsize="small")
    return fig
