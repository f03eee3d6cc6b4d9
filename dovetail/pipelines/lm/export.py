"""`dovetail export` of a language-model run (`PipelineKind.export`)."""

from collections.abc import Callable
from pathlib import Path

from dovetail.models.causal_lm import export_builtin_lm, export_causal_lm
from dovetail.models.training import make_optimizer
from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.pipelines.lm.model import lm_checkpoint_io, load_policy
from dovetail.run_dir import load_checkpoint


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
