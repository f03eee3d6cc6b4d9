"""`dovetail export` of a flow run (`PipelineKind.export`)."""

from collections.abc import Callable
from pathlib import Path

from dovetail.models.diffusers_flow import export, load_diffusers_checkpoint, load_flow_model
from dovetail.models.training import make_optimizer
from dovetail.pipelines.flow.config import FlowTrainConfig
from dovetail.run_dir import load_checkpoint


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
