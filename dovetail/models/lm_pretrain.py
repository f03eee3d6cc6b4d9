"""Supervised pretraining of the tiny language model on a task's ideal completions (train split only).

Deliberately short: the base model should know the format and mostly the algorithm, yet slip when it samples at
temperature 1, so that GRPO, which trains on those samples, has room to sharpen it. The default step count is
chosen for that (each task's `pretrain_steps`).
"""

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from transformers import LlamaForCausalLM

from dovetail.models.lm import LMConfig, build_lm, generate, save_lm
from dovetail.models.tokenizer import CharTokenizer
from dovetail.rewards.text import exact_answer
from dovetail.tasks import Task, task

EVAL_SEED = 0  # the held-out prompts every evaluation uses, whatever seed trained the model
IGNORE = -100  # label of a token the loss skips (the prompt and the padding)
BUCKET_STEPS = 8  # batches drawn together and cut by length, so a batch pads little


class Evaluation(NamedTuple):
    success: float  # mean exact_answer reward over the held-out prompts, as GRPO would score them
    lengths: list[int]  # completion lengths in tokens, eos included


def training_batch(tokenizer: CharTokenizer, task: Task, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids bos + prompt + solution + eos, right-padded, and labels that keep only what the model writes: the
    completion and eos, less what an agentic task's environment writes in it (`Task.observation_pattern`, one token
    a character), as RL masks it.

    Right padding needs no attention mask: a causal model never looks ahead at the pads, and their labels are
    ignored.
    """
    rows, labels = [], []
    for prompt in prompts:
        prompt_ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
        solution = task.solution(prompt)
        completion_ids = [*tokenizer.encode(solution), tokenizer.eos_id]
        written = list(completion_ids)
        observations = task.observation_pattern.finditer(solution) if task.observation_pattern else ()
        for observation in observations:
            written[observation.start() : observation.end()] = [IGNORE] * len(observation.group())
        rows.append(prompt_ids + completion_ids)
        labels.append([IGNORE] * len(prompt_ids) + written)
    width = max(map(len, rows))
    input_ids = torch.tensor([row + [tokenizer.pad_id] * (width - len(row)) for row in rows])
    return input_ids, torch.tensor([row + [IGNORE] * (width - len(row)) for row in labels])


def length_bucketed_prompts(task: Task, seed: int, steps: int, batch_size: int) -> Iterator[tuple[Task, list[str]]]:
    """The task and train prompts of each step: BUCKET_STEPS batches' worth drawn at once from the task pretraining
    trains on there (`Task.for_pretraining`), ordered by text length, cut into batches taken in a seeded random
    order. Halves the padding of the sorted tasks, whose lengths vary fivefold."""
    for bucket in range(-(-steps // BUCKET_STEPS)):
        stage = task.for_pretraining(bucket * BUCKET_STEPS / steps)
        prompts = stage.prompts("train", seed, bucket, BUCKET_STEPS * batch_size)
        prompts.sort(key=lambda prompt: len(prompt) + len(stage.solution(prompt)))
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        random.Random(f"{seed}/{bucket}").shuffle(batches)
        yield from ((stage, batch) for batch in batches[: steps - bucket * BUCKET_STEPS])


def evaluate(
    model: LlamaForCausalLM,
    tokenizer: CharTokenizer,
    task: Task,
    *,
    count: int = 200,
    temperature: float,
    seed: int = 0,
) -> Evaluation:
    """Success on the first count held-out prompts, sampling at temperature (0: greedy) from seed."""
    prompts = task.prompts("eval", EVAL_SEED, 0, count)
    generator = torch.Generator().manual_seed(seed)
    completions = generate(
        model, tokenizer, prompts, max_new_tokens=task.max_new_tokens, temperature=temperature, generator=generator
    )
    solved = exact_answer([tokenizer.decode(ids) for ids in completions], prompts)
    return Evaluation(float(solved.mean()), [len(ids) for ids in completions])


def describe_lengths(lengths: list[int]) -> str:
    q = np.percentile(lengths, [0, 50, 90, 100])
    return f"completion tokens min {q[0]:.0f} / median {q[1]:.0f} / p90 {q[2]:.0f} / max {q[3]:.0f}"


def pretrain_lm(
    task_name: str,
    out_dir: Path | str,
    *,
    steps: int | None = None,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 1e-3,
    warmup: int = 20,
    log_every: int = 50,
    eval_count: int = 200,
    config: LMConfig | None = None,
) -> tuple[LlamaForCausalLM, CharTokenizer, LMConfig]:
    """Train for `steps` (None: the task's `pretrain_steps`, what made its shipped model), write the checkpoint to
    out_dir, print the held-out success; the same seed gives the same bits.

    The learning rate warms up linearly, then decays on a cosine to zero at the last step.
    """
    torch.manual_seed(seed)
    task_ = task(task_name)
    steps = task_.pretrain_steps if steps is None else steps
    tokenizer = CharTokenizer() if task_.alphabet is None else CharTokenizer(task_.alphabet)
    config = config or LMConfig(task=task_name, vocab_size=tokenizer.vocab_size)
    model = build_lm(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + np.cos(np.pi * s / steps)))
    )
    start = time.time()
    for step, (stage, prompts) in enumerate(length_bucketed_prompts(task_, seed, steps, batch_size)):
        input_ids, labels = training_batch(tokenizer, stage, prompts)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps - 1:
            print(
                f"pretrain {task_name} step {step:5d}  loss {loss.item():.4f}  {time.time() - start:6.1f}s", flush=True
            )
    model.eval()
    save_lm(model, tokenizer, config, out_dir)
    print(f"wrote {out_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters)", flush=True)
    if task_.environment is not None:
        print(
            f"held-out success of {task_name} is its episodes' in environment {task_.environment!r}: the first "
            f"evaluation (step 0) of a run with env.name={task_.environment} (configs/{task_name}.yaml)",
            flush=True,
        )
        return model, tokenizer, config
    for temperature in (1.0, 0.0):
        result = evaluate(model, tokenizer, task_, count=eval_count, temperature=temperature)
        print(
            f"held-out success at temperature {temperature:g}: {result.success:.3f} on {eval_count} prompts; "
            f"{describe_lengths(result.lengths)}",
            flush=True,
        )
    return model, tokenizer, config
