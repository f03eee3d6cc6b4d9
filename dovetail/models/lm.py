"""A tiny causal language model: transformers' Llama at a few million parameters, on our character tokenizer.

Small enough that GRPO samples and trains it on two CPU cores in minutes, real enough that the rollout and
training code written for it (KV cache, logits, log-probs of completions) is the code a large Llama runs.
"""

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from transformers import LlamaConfig, LlamaForCausalLM

from dovetail.files import one_line, read_text
from dovetail.models.engine import CACHE
from dovetail.models.tokenizer import CharTokenizer

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"


class LMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str  # the task whose text the model learned: its prompts are the only ones it can read
    vocab_size: int
    hidden: int = 128
    layers: int = 5
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    max_positions: int = 128  # bos, the longest prompt and max_new_tokens of every task fit
    rope_theta: float = 10_000.0
    tie_embeddings: bool = True


def checkpoint_dir(task: str) -> Path:
    """Where the shipped base model of a task lives."""
    return ASSETS_DIR / f"{task}-lm"


def build_lm(config: LMConfig) -> LlamaForCausalLM:
    """A freshly initialised fp32 Llama (initialised from torch's global generator: seed it first).

    Eager attention: plain fp32 matmuls and softmax, the same arithmetic on every backend, where SDPA may pick a
    fused kernel with another reduction order.
    """
    llama_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        intermediate_size=config.intermediate,
        max_position_embeddings=config.max_positions,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
        dtype=torch.float32,
    )
    return LlamaForCausalLM(llama_config).float()


def save_lm(model: LlamaForCausalLM, tokenizer: CharTokenizer, config: LMConfig, directory: Path | str) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_model(model, str(directory / "model.safetensors"))  # stores a tied embedding once
    tokenizer.save(directory)
    (directory / "config.json").write_text(config.model_dump_json(indent=2) + "\n")


CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json")
"""What `save_lm` writes, and a checkpoint directory holds."""


def require_checkpoint(directory: Path | str) -> Path:
    """The checkpoint directory, or one line saying what is missing: where there is no model at all, how to make
    one; where only some files are, which (pretraining there would overwrite the model that is)."""
    directory = Path(directory)
    missing = [name for name in CHECKPOINT_FILES if not (directory / name).exists()]
    if "model.safetensors" in missing:
        task = directory.name.removesuffix("-lm") if directory.name.endswith("-lm") else "<task>"
        raise FileNotFoundError(
            f"no language-model checkpoint in {directory}; run `dovetail pretrain {task} --out {directory}` to make one"
        )
    if missing:
        raise FileNotFoundError(
            f"{directory} holds a model but no {' or '.join(missing)}: copy in what was saved with that model (a "
            f"checkpoint holds {', '.join(CHECKPOINT_FILES)})"
        )
    return directory


def load_tokenizer(directory: Path | str) -> CharTokenizer:
    return CharTokenizer.load(require_checkpoint(directory))


def read_lm_config(directory: Path) -> LMConfig:
    path = directory / "config.json"
    text = read_text(path, "the config.json `dovetail pretrain` writes")
    try:
        return LMConfig(**json.loads(text))
    except (ValueError, TypeError) as error:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"unreadable {path}: {one_line(error)}") from None


def load_lm(directory: Path | str) -> tuple[LlamaForCausalLM, CharTokenizer, LMConfig]:
    """The model (in eval mode), its tokenizer and its config; a missing checkpoint says how to make one, weights
    that do not load (a damaged file, another model's) and a tokenizer of another vocabulary (whose ids the embedding
    lacks, or that cannot decode what the model samples) are one line naming the file."""
    directory = require_checkpoint(directory)
    config = read_lm_config(directory)
    tokenizer = CharTokenizer.load(directory)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(
            f"{directory / 'tokenizer.json'} has {tokenizer.vocab_size} tokens and the model "
            f"({directory / 'config.json'}) {config.vocab_size}: give the checkpoint the tokenizer.json saved with "
            "its model"
        )
    model = build_lm(config)
    weights = directory / "model.safetensors"
    try:
        load_model(model, str(weights))
    except (SafetensorError, RuntimeError, OSError) as error:  # a damaged header; a tensor missing or misshapen
        raise ValueError(
            f"cannot load {weights} into the model {directory / 'config.json'} describes: {one_line(error)}"
        ) from None
    return model.eval(), tokenizer, config


@torch.no_grad()
def generate(
    model: LlamaForCausalLM,
    tokenizer: CharTokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Completion token ids of each prompt (up to and including eos), sampled at temperature, or greedy at 0.

    Prompts of equal length decode together, in order of length, so no padding ever enters the arithmetic and no
    attention mask is needed.
    """
    completions: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    encoded = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in prompts]
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    for length in sorted(by_length):
        rows = by_length[length]
        input_ids = torch.tensor([encoded[i] for i in rows])
        finished = torch.zeros(len(rows), dtype=torch.bool)
        cache = None
        for _ in range(max_new_tokens):
            output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{CACHE: cache})
            cache, logits = getattr(output, CACHE), output.logits[:, -1]
            if temperature == 0:
                tokens = logits.argmax(-1)
            else:
                tokens = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
            for row, token, done in zip(rows, tokens.tolist(), finished.tolist()):
                if not done:
                    completions[row].append(token)
            finished |= tokens == tokenizer.eos_id
            if finished.all():
                break
            input_ids = tokens[:, None]
    return completions
