"""What a language-model run loads as its config names it, wherever its model is held (the engines, the driver's
adapter, the start-up checks, the reference loop, the export): the policy and its tokenizer (a user's transformers
model with its LoRA adapter, `models.causal_lm`, or a built-in task's tiny Llama), the frozen reference, the model's
context, the prompts as token ids that leave room in it, the rollout engine's sampling and cache length, and the
format of the run's checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

from dovetail.envs.toolcalls import convention
from dovetail.models.causal_lm import (
    HFTokenizer,
    StopStrings,
    context_of,
    load_causal_lm,
    load_causal_lm_checkpoint,
    save_causal_lm_checkpoint,
)
from dovetail.models.engine import SamplingParams
from dovetail.models.lm import load_lm, load_tokenizer, read_lm_config, save_lm
from dovetail.models.tokenizer import CharTokenizer
from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.pipelines.lm.prompts import RunPrompts
from dovetail.prompts import Row


def load_policy(config: LMTrainConfig):
    """The run's base policy and its tokenizer: a user's transformers model (`model.path`, with its LoRA adapter),
    or a built-in task's model."""
    path = config.model.path
    if path is not None:
        lora = None if config.model.lora is None else config.model.lora.model_dump()
        return load_causal_lm(path, lora=lora, seed=config.seed), load_run_tokenizer(config)
    model, _, _ = load_lm(config.builtin_checkpoint)
    return model, load_run_tokenizer(config)


def load_reference(config: LMTrainConfig):
    """The frozen base model a KL term compares with: the policy's start, a user's model without its adapter."""
    path = config.model.path
    if path is not None:
        return load_causal_lm(path, lora=None, seed=config.seed)
    return load_policy(config)[0]


def load_run_tokenizer(config: LMTrainConfig) -> HFTokenizer | CharTokenizer:
    """The run's tokenizer, loaded once in a process while its files are unchanged: the driver's start-up check, its
    reference model and its adapter all read it (a transformers tokenizer takes a good part of a second to load)."""
    path = config.model.path
    directory = path if path is not None else Path(config.builtin_checkpoint)
    return _tokenizer(directory, path is not None, _stamp(directory))


def _stamp(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """What tells a model directory's versions apart for the cache: its files' names, sizes and modification times."""
    if not directory.is_dir():
        return ()
    return tuple((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns) for entry in sorted(directory.iterdir()))


@lru_cache(maxsize=4)
def _tokenizer(directory: Path, user_model: bool, stamp: tuple) -> HFTokenizer | CharTokenizer:
    return HFTokenizer.load(directory) if user_model else load_tokenizer(directory)


def model_context(config: LMTrainConfig) -> int:
    """The positions the run's model reads: prompt and response together fit in them."""
    path = config.model.path
    if path is not None:
        return context_of(path)
    return read_lm_config(config.builtin_checkpoint).max_positions


def encode_prompts(config: LMTrainConfig, tokenizer, rows: list[Row], context: int) -> list[list[int]]:
    """The prompts' token ids, each `fitted_prompt`: a prompt too long is the config's error, named before any work
    is sent."""
    return [fitted_prompt(config, tokenizer.prompt_ids(row.prompt), row.prompt, context) for row in rows]


def fitted_prompt(config: LMTrainConfig, ids: list[int], prompt: str | list, context: int) -> list[int]:
    """A prompt's token ids as the run feeds them (a longer one than prompts.max_tokens keeps its last tokens),
    checked to leave room in the model's `context` for max_new_tokens, else one line naming the prompt and the fix."""
    limit = config.prompts.max_tokens if config.prompts is not None else None
    if limit is not None:
        ids = ids[-limit:]
    if not ids or len(ids) + config.max_new_tokens > context:
        where = config.model.path or config.model.checkpoint
        fix = "set prompts.max_tokens (keeps a prompt's last tokens) or " if config.user_model else ""
        raise ValueError(
            f"prompt {str(prompt)[:200]!r} ({len(ids)} tokens) and sampling.max_new_tokens={config.max_new_tokens} "
            f"exceed the model's context of {context} tokens ({where}): {fix}lower sampling.max_new_tokens"
        )
    return ids


def engine_length(config: LMTrainConfig, tokenizer, prompts: RunPrompts, context: int) -> int:
    """The positions a rollout engine's cache holds: the model's context, or for a dataset the longest prompt (at
    most prompts.max_tokens) and max_new_tokens, where that is less (a large model's context would be a cache of
    gigabytes). An env run's prompts are its environment's first observations: prompts.max_tokens bounds them."""
    if config.env is not None:
        limit = config.prompts.max_tokens if config.prompts is not None else None
        return context if limit is None else min(context, limit + config.max_new_tokens)
    rows = prompts.all()
    if not rows:
        return context
    encoded = encode_prompts(config, tokenizer, rows, context)
    return min(context, max(map(len, encoded)) + config.max_new_tokens)


def sampling_params(config: LMTrainConfig, stop_ids: tuple[int, ...], seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        max_new_tokens=config.max_new_tokens,
        stop_ids=stop_ids,
        seed=config.seed if seed is None else seed,
        max_turn_tokens=config.env.max_turn_tokens if config.env is not None else None,
        multi_turn=config.env is not None,
    )


def stop_strings(config: LMTrainConfig, tokenizer, tools: Sequence[dict] = ()) -> StopStrings | None:
    """Where a response (an env run's: a model turn) ends besides its end of sequence: `sampling.stop`, and in an env
    run the text that closes a call of one of `tools` (their schemas), after which the environment answers."""
    stops = list(config.sampling.stop)
    if config.env is not None:
        stops += convention(config.env.parser).call_ends([tool["function"]["name"] for tool in tools])
    return StopStrings(tokenizer, stops) if stops else None


def lm_checkpoint_io(config: LMTrainConfig, model, tokenizer) -> tuple[Callable, Callable]:
    """(save_weights, load_weights) of an LM run's checkpoints for `RunDir`: the built-in model's own format, or a
    transformers model's trained tensors and where it came from."""
    if config.user_model:
        return (lambda directory: save_causal_lm_checkpoint(model, directory)), load_causal_lm_checkpoint
    lm_config = read_lm_config(config.builtin_checkpoint)
    return (lambda directory: save_lm(model, tokenizer, lm_config, directory)), (lambda d: load_lm(d)[0])
