"""GRPO on a user's own language model and dataset, end to end, as a user of TRL or verl would bring them: a small
transformers `LlamaForCausalLM` pretrained here (deliberately briefly) on a synthetic dataset written as jsonl, saved
with `save_pretrained`, then trained through `model.path` + `prompts.path` with the built-in `answer_match` reward;
the held-out reward (one sampled answer per test prompt) rises.

    python benchmarks/user_lm.py --out runs/user-lm            # ~2 min pretraining, ~1.5 min GRPO on 2 CPU cores

The dataset: "a+b=" for a, b below 50, the answer in the `answer` column; a hash of each pair keeps a tenth out as
test.jsonl. The tokenizer is one token per character (`dovetail.models.tokenizer.CharTokenizer`, saved as a
transformers tokenizer). Prints the base and final held-out reward (also in OUT/run/summary.json).
"""

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from dovetail import train
from dovetail.config.load import load_config
from dovetail.models.tokenizer import CharTokenizer

ALPHABET = "0123456789+="
IGNORE = -100


def dataset(directory: Path) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of every "a+b=" with a, b < 50, split by a hash of the prompt."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(50) for b in range(50)]
    held = [hashlib.sha256(r["prompt"].encode()).digest()[0] < 26 for r in rows]  # about a tenth
    paths = directory / "train.jsonl", directory / "test.jsonl"
    for path, keep in zip(paths, (False, True)):
        path.write_text("".join(json.dumps(r) + "\n" for r, h in zip(rows, held) if h == keep))
    return paths


def pretrain(directory: Path, train_file: Path, steps: int, seed: int) -> Path:
    """A 4-layer, 64-wide Llama trained on the train rows' answers for `steps` batches of 64 (prompt tokens
    unlabelled), saved with its tokenizer in save_pretrained layout: what a user brings as model.path."""
    torch.manual_seed(seed)
    chars = CharTokenizer(ALPHABET)
    config = LlamaConfig(
        vocab_size=chars.vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        pad_token_id=chars.pad_id,
        bos_token_id=chars.bos_id,
        eos_token_id=chars.eos_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(rows, 64)
        sequences = [(chars.prompt_ids(r["prompt"]), [*chars.encode(r["answer"]), chars.eos_id]) for r in batch]
        width = max(len(p) + len(a) for p, a in sequences)
        ids = torch.tensor([p + a + [chars.pad_id] * (width - len(p) - len(a)) for p, a in sequences])
        labels = torch.tensor([[IGNORE] * len(p) + a + [IGNORE] * (width - len(p) - len(a)) for p, a in sequences])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    chars.to_transformers().save_pretrained(directory)
    return directory


def user_config(model: Path, train_file: Path, test_file: Path, policy: str, steps: int, **sections) -> dict:
    """The run config a user writes for their model and dataset (as TRL's GRPOTrainer takes them); `sections`
    replace whole sections (`sampling`, `algo`, `eval`, ...)."""
    return {
        "kind": "lm",
        "policy": policy,
        "model": {"path": str(model)},
        "prompts": {"path": str(train_file), "eval_path": str(test_file)},
        "reward": {"answer_match": 1.0},
        "sampling": {"max_new_tokens": 4},
        "algo": {"prompts_per_step": 16, "group_size": 8},
        "train": {"steps": steps, "lr": 3e-4},
        "eval": {"prompts": 250, "every": 25},
        "checkpoint": {"every": steps},
    } | sections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/user-lm"))
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--policy", default="reference")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    train_file, test_file = dataset(args.out)
    start = time.perf_counter()
    model = pretrain(args.out / "my-llama", train_file, args.pretrain_steps, seed=0)
    print(f"pretrained {model} in {time.perf_counter() - start:.0f} s")
    config = user_config(model, train_file, test_file, args.policy, args.steps)
    (args.out / "my_lm.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    start = time.perf_counter()
    summary = train(load_config(args.out / "my_lm.yaml"), out=args.out / "run", overwrite=True)
    print(
        f"held-out reward {summary['base_eval_reward']:.3f} -> {summary['final_eval_reward']:.3f} after {args.steps} "
        f"GRPO steps ({args.policy}, {time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
