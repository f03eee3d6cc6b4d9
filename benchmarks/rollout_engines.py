"""Start-up, peak memory and tokens/s of the three LM rollout engines (`sampling.engine`: dovetail, hf, vllm) on one
model and one set of prompts, each through the `Engine` contract as a GRPO rollout device calls it, and of
transformers' `generate` beside them.

    .venv-vllm/bin/python benchmarks/rollout_engines.py --repeats 5     # the environment with vLLM (make test-vllm)

The model is a random-init ~2 M-parameter Llama (4 layers, 256 wide, 8 heads of 32, 2 kv heads, vocabulary 64: the
`random` case of benchmarks/lm_engine.py), fp32; the prompts are `--batch` equal-length random prompts of 16 tokens,
each decoded for `--new-tokens` tokens with no stop id (temperature 1), so every engine produces the same number of
tokens. Each engine runs in a process of its own (its peak memory is its own): start-up is building the engine and
loading the weights; tokens/s is the median over `--repeats` generations after one warm-up; peak memory is the
process's maximum resident set, and the share of it above the process after its imports.
"""

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

ENGINES = ("dovetail", "hf", "vllm", "generate")
"""The three `sampling.engine`s, and transformers' `model.generate(do_sample=True)` itself (no `Engine` contract: no
keyed draws, no pause) for scale."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(engine_name: str, batch: int, new_tokens: int, repeats: int) -> dict:
    """One engine's figures, in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dovetail.models.causal_lm import rollout_engine
    from dovetail.models.engine import Request, SamplingParams

    sys.path.insert(0, os.path.dirname(__file__))
    from lm_engine import RANDOM_CONFIG

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**RANDOM_CONFIG)).float().eval()
    prompts = torch.randint(3, RANDOM_CONFIG["vocab_size"], (batch, 16)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, seed=0)
    after_imports = peak_rss_mb()
    start = time.perf_counter()
    if engine_name == "generate":
        ids = torch.tensor(prompts)

        def decode(round_: int) -> int:
            with torch.no_grad():
                out = model.generate(ids, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            return out[:, ids.shape[1] :].numel()

    else:
        engine = rollout_engine(
            model, params, max_len=16 + new_tokens, device=torch.device("cpu"), max_batch=batch, engine=engine_name
        )

        def decode(round_: int) -> int:
            results = engine.generate([Request((round_, i, 0), p) for i, p in enumerate(prompts)])
            return sum(len(r.tokens) for r in results)

    startup = time.perf_counter() - start
    rates = []
    for round_ in range(repeats + 1):
        start = time.perf_counter()
        tokens = decode(round_)
        seconds = time.perf_counter() - start
        if round_ > 0:  # the first is the warm-up
            rates.append(tokens / seconds)
    peak = peak_rss_mb()
    return {
        "engine": engine_name,
        "startup_s": round(startup, 2),
        "tokens_per_s": round(statistics.median(rates)),
        "tokens_per_s_range": [round(min(rates)), round(max(rates))],
        "peak_rss_mb": round(peak),
        "peak_above_imports_mb": round(peak - after_imports),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--one", choices=ENGINES, help=argparse.SUPPRESS)  # a child process: one engine
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.batch, args.new_tokens, args.repeats)))
        return
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    print(f"batch {args.batch} prompts x 16 tokens, {args.new_tokens} new tokens each, {args.repeats} repeats")
    print("| engine | start-up (s) | tokens/s (median, range) | peak RSS (MB) | above imports (MB) | torch threads |")
    print("|---|---|---|---|---|---|")
    for name in args.engines:
        child = [sys.executable, __file__, "--one", name, "--batch", str(args.batch)]
        child += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        output = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        row = json.loads(output.strip().splitlines()[-1])
        low, high = row["tokens_per_s_range"]
        print(
            f"| {name} | {row['startup_s']} | {row['tokens_per_s']} ({low}-{high}) | {row['peak_rss_mb']} "
            f"| {row['peak_above_imports_mb']} | {row['torch_threads']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
