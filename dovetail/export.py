"""`dovetail export`: a run's checkpoint written back as its model library's own directory that `from_pretrained`
loads (a user's diffusers model: a diffusers directory; a language model: a transformers one), after the checks a
resume makes; each pipeline kind exports its own (`PipelineKind.export`)."""

from pathlib import Path

from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.kinds import KINDS
from dovetail.run_dir import BrokenCheckpoint, checkpoint_dirs


def export_run(run: Path, step: int | None, out: Path) -> Path:
    """Export checkpoint `step` (None: the newest) of the run directory `run` into `out` (`export`), after checking
    it as a resume would (manifest, checksums, the weights fit the run's model). Returns the checkpoint exported.
    A run directory, step or output that will not do is a ValueError, one line naming it and the fix."""
    if not (run / "config.yaml").is_file():
        raise ValueError(f"{run}: no config.yaml; give the run directory of a `dovetail train` run")
    try:
        config = load_config(run / "config.yaml", rewards=False)  # an export scores nothing: import none
    except ConfigError as error:
        raise ValueError(f"{run / 'config.yaml'}: {error}") from None
    if config.kind not in KINDS:
        raise ValueError(f"{run} is a {config.kind} run: export one of its pipelines' directories, {run}/<pipeline>")
    try:
        write = KINDS[config.kind].load("export")(config)
    except ValueError as error:  # the run trained nothing that exports
        raise ValueError(f"{run}: {error}") from None
    steps = dict(checkpoint_dirs(run / "checkpoints"))
    if not steps:
        raise ValueError(f"{run}: no checkpoint in {run / 'checkpoints'}")
    step = max(steps) if step is None else step
    if step not in steps:
        raise ValueError(f"{run}: no checkpoint of step {step}; --step one of {sorted(steps)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory; give a new directory to export into")
    try:
        write(steps[step], out)
    except BrokenCheckpoint as error:
        raise ValueError(str(error)) from None
    return steps[step]
