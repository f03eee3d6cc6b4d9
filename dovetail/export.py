"""`dovetail export`: a run's checkpoint written back as its model library's own directory that `from_pretrained`
loads (a user's diffusers model: a diffusers directory; a language model: a transformers one), after the checks a
resume makes; each pipeline kind exports its own (`PipelineKind.export`)."""

from collections.abc import Callable
from pathlib import Path

from dovetail.config.common import ConfigError
from dovetail.config.flow import FlowTrainConfig
from dovetail.config.lm import LMTrainConfig
from dovetail.config.load import load_config
from dovetail.exec.lm_model import lm_checkpoint_io, load_policy
from dovetail.kinds import KINDS
from dovetail.models.causal_lm import export_builtin_lm, export_causal_lm
from dovetail.models.diffusers_flow import export, load_diffusers_checkpoint, load_flow_model
from dovetail.models.training import make_optimizer
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


def flow_exporter(config: FlowTrainConfig) -> Callable[[Path, Path], None]:
    """`dovetail export` of a flow run: a user's diffusers model (`models.diffusers_flow.export`) with a
    checkpoint's weights; the built-in model's checkpoints are its own format already."""
    if config.model.path is None:
        raise ValueError(
            "it trained no model.path: export writes the diffusers directory of a run of a diffusers model "
            "(a built-in model's checkpoints/step_N is its own format)"
        )

    def write(checkpoint: Path, out: Path) -> None:
        model = load_flow_model(config)
        load_checkpoint(checkpoint, model, make_optimizer(model, config.train), load_diffusers_checkpoint)
        export(model, out)

    return write


def lm_exporter(config: LMTrainConfig) -> Callable[[Path, Path], None]:
    """`dovetail export` of an LM run: a transformers directory of a checkpoint's model (`models.causal_lm`): a
    user's model with its tokenizer (a LoRA adapter merged in, and in peft's layout in lora/), or a built-in task's
    model with its character tokenizer as a transformers tokenizer."""

    def write(checkpoint: Path, out: Path) -> None:
        model, tokenizer = load_policy(config)
        _, load_weights = lm_checkpoint_io(config, model, tokenizer)
        load_checkpoint(checkpoint, model, make_optimizer(model, config.train), load_weights)
        if config.user_model:
            export_causal_lm(model, out)
        else:
            export_builtin_lm(model, tokenizer, out)

    return write
