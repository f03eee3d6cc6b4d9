"""`dovetail export` of a flow run (`PipelineKind.export`)."""

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from dovetail.models.diffusers_flow import export, load_diffusers_checkpoint, load_flow_model
from dovetail.models.training import make_optimizer
from dovetail.pipelines.flow.config import FlowTrainConfig
from dovetail.pipelines.flow.ema import trained_parameters
from dovetail.pipelines.flow.local import EMA_FILE
from dovetail.run_dir import load_checkpoint

EMA_DIR = "ema"
"""Where an export of a run with eval.ema writes the EMA's weights: a diffusers directory of its own, inside the
export's."""


def flow_exporter(config: FlowTrainConfig) -> Callable[[Path, Path], None]:
    """`dovetail export` of a flow run: a user's diffusers model (`models.diffusers_flow.export`) with a
    checkpoint's weights, and where the checkpoint holds an EMA of them (eval.ema) the same model with the EMA's
    weights in EMA_DIR; the built-in model's checkpoints are its own format already."""
    if config.model.path is None:
        raise ValueError(
            "it trained no model.path: export writes the diffusers directory of a run of a diffusers model "
            "(a built-in model's checkpoints/step_N is its own format)"
        )

    def checkpointed_model(checkpoint: Path):
        model = load_flow_model(config)
        load_checkpoint(checkpoint, model, make_optimizer(model, config.train), load_diffusers_checkpoint)
        return model

    def write(checkpoint: Path, out: Path) -> None:
        export(checkpointed_model(checkpoint), out)
        if (checkpoint / EMA_FILE).is_file():
            model, average = checkpointed_model(checkpoint), load_file(checkpoint / EMA_FILE)
            with torch.no_grad():
                for name, parameter in trained_parameters(model).items():
                    parameter.copy_(average[name])
            export(model, out / EMA_DIR)

    return write
