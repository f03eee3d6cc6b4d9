"""Tokens/s of our TorchEngine against transformers `model.generate(do_sample=True)`, same model and prompts.

    .venv/bin/python benchmarks/lm_engine.py --repeats 5

A random-init ~2 M-parameter Llama (fp32, eval), one torch thread, a batch of equal-length random prompts,
`--new-tokens` sampled per sequence at temperature 1 with no stop id, so both generate exactly the same
number of tokens. Each round times every (generator, batch size) pair once, in turn, so that the machine's
drift falls on all alike; the table gives the median tokens/s over the rounds and the range.
"""

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dovetail.models.engine import Request, SamplingParams, TorchEngine

CONFIG = {
    "vocab_size": 64,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 256,
}


def time_engine(model, prompts: list[list[int]], new_tokens: int) -> float:
    """A rollout worker keeps its engine; what a step pays is the weight load and the generation."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    max_len = len(prompts[0]) + new_tokens
    engine = TorchEngine(model.config, params, max_batch=len(prompts), num_slots=len(prompts), max_len=max_len)
    start = time.perf_counter()
    engine.load_weights(model.state_dict())
    results = engine.generate([Request((0, i, 0), prompt) for i, prompt in enumerate(prompts)])
    elapsed = time.perf_counter() - start
    assert sum(len(r.tokens) for r in results) == len(prompts) * new_tokens
    return elapsed


@torch.no_grad()
def time_hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=None,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    elapsed = time.perf_counter() - start
    assert output.shape[1] == ids.shape[1] + new_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    params = sum(p.numel() for p in model.parameters())
    prompts = torch.randint(1, CONFIG["vocab_size"], (max(args.batches), args.prompt_len)).tolist()
    generators = {"TorchEngine": time_engine, "HF generate": time_hf}
    for run in generators.values():  # warm-up: first-call allocations and lazy imports
        run(model, prompts[:2], 4)
    tokens_per_s = {(name, batch): [] for name in generators for batch in args.batches}
    for _ in range(args.repeats):
        for batch in args.batches:
            for name, run in generators.items():
                elapsed = run(model, prompts[:batch], args.new_tokens)
                tokens_per_s[name, batch].append(batch * args.new_tokens / elapsed)

    print(
        f"{params / 1e6:.1f} M params, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"1 thread, {args.repeats} rounds\n"
    )
    print("| generator | batch | tokens/s (median) | range | speed-up |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        baseline = statistics.median(tokens_per_s["HF generate", batch])
        for name in generators:
            values = tokens_per_s[name, batch]
            median, spread = statistics.median(values), f"{min(values):.0f}–{max(values):.0f}"
            print(f"| {name} | {batch} | {median:.0f} | {spread} | {median / baseline:.2f}x |")


if __name__ == "__main__":
    main()
