"""Tokens/s of our TorchEngine against transformers `model.generate(do_sample=True)`, same model and prompts.

    .venv/bin/python benchmarks/lm_engine.py --repeats 7

Two cases, one torch thread, temperature 1, top-p 1:

* sort-lm: the model we ship (dovetail/assets/sort-lm, ~1.3 M params, vocabulary 53) on the sort task's train
  prompts (bos + characters, 10-25 tokens), stopping at eos or the task's max_new_tokens, as a GRPO rollout
  decodes them. HF generate left-pads the prompts and runs until every row has stopped; the tokens counted for
  either generator are the ones it returned, each row up to and including its eos. Both sample from the same
  model, so the two produce the same number of tokens on average, not token for token.
* random: a random-init ~2 M-parameter Llama (vocabulary 64) on equal-length random prompts, `--new-tokens`
  per sequence with no stop id, so both generate exactly the same number of tokens.

Each round times every (case, batch, generator) once, in turn, so that the machine's drift falls on all alike;
the table gives the median tokens/s over the rounds and its range, and the speed-up of the medians.
"""

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dovetail.models.engine import Request, SamplingParams, TorchEngine
from dovetail.models.lm import load_lm
from dovetail.tasks import task

SORT_LM = Path(__file__).resolve().parents[1] / "dovetail" / "assets" / "sort-lm"
RANDOM_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 256,
}


class Case:
    """One model, its prompts and how to stop: what both generators are given."""

    def __init__(self, name: str, model, prompts: list[list[int]], new_tokens: int, stop_id: int | None, pad_id: int):
        self.name, self.model, self.prompts = name, model, prompts
        self.new_tokens, self.stop_id, self.pad_id = new_tokens, stop_id, pad_id

    def time_engine(self, batch: int) -> tuple[float, int]:
        """A rollout worker keeps its engine; what a step pays is the weight load and the generation."""
        prompts = self.prompts[:batch]
        stop_ids = () if self.stop_id is None else (self.stop_id,)
        params = SamplingParams(temperature=1.0, max_new_tokens=self.new_tokens, stop_ids=stop_ids)
        max_len = max(map(len, prompts)) + self.new_tokens
        engine = TorchEngine(self.model.config, params, max_batch=batch, num_slots=batch, max_len=max_len)
        start = time.perf_counter()
        engine.load_weights(self.model.state_dict())
        results = engine.generate([Request((0, i, 0), prompt) for i, prompt in enumerate(prompts)])
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(r.tokens) for r in results)

    @torch.no_grad()
    def time_hf(self, batch: int) -> tuple[float, int]:
        prompts = self.prompts[:batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        output = self.model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=1.0,
            max_new_tokens=self.new_tokens,
            min_new_tokens=self.new_tokens if self.stop_id is None else 0,
            eos_token_id=self.stop_id,
            pad_token_id=self.pad_id,
        )
        elapsed = time.perf_counter() - start
        return elapsed, sum(map(self._length, output[:, width:].tolist()))

    def _length(self, row: list[int]) -> int:
        """Tokens up to and including the first stop id (HF pads the rows that stopped before the others)."""
        return row.index(self.stop_id) + 1 if self.stop_id in row else len(row)


def sort_case(count: int) -> Case:
    model, tokenizer, _ = load_lm(SORT_LM)
    sort = task("sort")
    prompts = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in sort.prompts("train", 0, 0, count)]
    return Case("sort-lm", model, prompts, sort.max_new_tokens, tokenizer.eos_id, tokenizer.pad_id)


def random_case(count: int, prompt_len: int, new_tokens: int) -> Case:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**RANDOM_CONFIG)).eval()
    prompts = torch.randint(1, RANDOM_CONFIG["vocab_size"], (count, prompt_len)).tolist()
    return Case("random", model, prompts, new_tokens, None, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--sort-batches", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--random-batches", type=int, nargs="*", default=[64])
    parser.add_argument("--new-tokens", type=int, default=128, help="random case: tokens per sequence")
    parser.add_argument("--prompt-len", type=int, default=16, help="random case: prompt tokens")
    args = parser.parse_args()

    torch.set_num_threads(1)
    runs = []
    if args.sort_batches:
        case = sort_case(max(args.sort_batches))
        runs += [(case, batch) for batch in args.sort_batches]
    if args.random_batches:
        case = random_case(max(args.random_batches), args.prompt_len, args.new_tokens)
        runs += [(case, batch) for batch in args.random_batches]
    generators = {"TorchEngine": Case.time_engine, "HF generate": Case.time_hf}
    for case in {id(case): case for case, _ in runs}.values():  # warm-up: first-call allocations, lazy imports
        for run in generators.values():
            run(case, 2)
    tokens_per_s = {(id(case), batch, name): [] for case, batch in runs for name in generators}
    tokens = dict.fromkeys(tokens_per_s, 0)
    for _ in range(args.repeats):
        for case, batch in runs:
            for name, run in generators.items():
                elapsed, count = run(case, batch)
                tokens_per_s[id(case), batch, name].append(count / elapsed)
                tokens[id(case), batch, name] += count

    command = shlex.join([".venv/bin/python", "benchmarks/lm_engine.py", *sys.argv[1:]])
    print(f"`{command}`: 1 torch thread, {args.repeats} interleaved rounds, tokens/s median (min–max)\n")
    print("| model | params | batch | prompt tokens | new tokens / seq | TorchEngine | HF generate | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for case, batch in runs:
        cells, medians = [], []
        for name in generators:
            values = tokens_per_s[id(case), batch, name]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:.0f} ({min(values):.0f}–{max(values):.0f})")
        params = sum(p.numel() for p in case.model.parameters()) / 1e6
        lengths = [len(p) for p in case.prompts[:batch]]
        per_seq = [tokens[id(case), batch, name] / (batch * args.repeats) for name in generators]
        print(
            f"| {case.name} | {params:.1f} M | {batch} | {min(lengths)}–{max(lengths)} | "
            f"{per_seq[0]:.1f} / {per_seq[1]:.1f} | {cells[0]} | {cells[1]} | {medians[0] / medians[1]:.2f}x |"
        )


if __name__ == "__main__":
    main()
