"""`dovetail export`: a checkpoint of a run of a user's diffusers model written back as a diffusers directory that
`from_pretrained` loads (`models.diffusers_flow.export`), after the checks a resume makes."""

from pathlib import Path

from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.kinds import KINDS, kind
from dovetail.models.diffusers_flow import export, load_diffusers_checkpoint, load_flow_model
from dovetail.recipe import make_optimizer
from dovetail.run_dir import BrokenCheckpoint, checkpoint_dirs, load_checkpoint


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
    if kind(config.kind).export is None:
        raise ValueError(f"{run} is a {config.kind} run: export writes runs of a kind with an exporter ({EXPORTED})")
    return kind(config.kind).load("export")(run, config, step, out)


def chosen_checkpoint(run: Path, step: int | None, out: Path) -> Path:
    """Checkpoint `step` of the run (None: the newest), checked to exist, with `out` new or empty."""
    steps = dict(checkpoint_dirs(run / "checkpoints"))
    if not steps:
        raise ValueError(f"{run}: no checkpoint in {run / 'checkpoints'}")
    step = max(steps) if step is None else step
    if step not in steps:
        raise ValueError(f"{run}: no checkpoint of step {step}; --step one of {sorted(steps)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory; give a new directory to export into")
    return steps[step]


def export_flow(run: Path, config, step: int | None, out: Path) -> Path:
    """A flow run's checkpoint as the diffusers directory of its model.path (`models.diffusers_flow.export`)."""
    if config.model.path is None:
        raise ValueError(
            f"{run} trained no model.path: export writes the diffusers directory of a run of a diffusers model "
            "(a built-in model's checkpoints/step_N is its own format)"
        )
    checkpoint = chosen_checkpoint(run, step, out)
    model = load_flow_model(config)
    try:
        load_checkpoint(checkpoint, model, make_optimizer(model, config), load_diffusers_checkpoint)
    except BrokenCheckpoint as error:
        raise ValueError(str(error)) from None
    export(model, out)
    return checkpoint


EXPORTED = ", ".join(name for name, registered in KINDS.items() if registered.export is not None)
