"""What keeping a finished turn's KV cache saves a multi-turn rollout on our engine (`SamplingParams.multi_turn`):
the calc task's trajectories (configs/calc.yaml: the built-in arithmetic environment, the calculator behind
<calc> tags, up to three turns) rolled out with the cache kept between turns and with every later turn re-prefilling
its whole trajectory, interleaved over rounds, the same samples and seed; the tokens each prefilled and the seconds.

    .venv/bin/python benchmarks/multiturn_cache.py --rounds 5 --prompts 32
"""

import argparse
import dataclasses
import statistics
import time

import torch

from dovetail.config.load import load_config
from dovetail.graph.node import SampleId
from dovetail.models.causal_lm import rollout_engine
from dovetail.pipelines.lm.engines import LMEngines
from dovetail.pipelines.lm.model import engine_length, model_context, sampling_params, stop_strings
from dovetail.pipelines.lm.multiturn import run_episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32, help="prompts a rollout; 8 trajectories each")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config("configs/calc.yaml")
    engines = LMEngines(config, torch.device("cpu"), True, None)
    rows = [engines.prompts.train(0, position) for position in range(args.prompts)]
    group = config.algo.group_size
    samples = [SampleId(0, p, i) for p in range(len(rows)) for i in range(group)]
    episode_rows = [engines.prompts.episode_row(row) for row in rows for _ in range(group)]
    max_len = engine_length(config, engines.tokenizer, engines.prompts, model_context(config))
    stop = stop_strings(config, engines.tokenizer, engines.tools)
    figures: dict[bool, list[tuple[float, int, int]]] = {True: [], False: []}
    tokens: dict[bool, list] = {}
    for _ in range(args.rounds):
        for kept in (True, False):
            params = dataclasses.replace(sampling_params(config, engines.tokenizer.stop_ids), multi_turn=kept)
            engine = rollout_engine(engines.trainer, params, max_len=max_len, device=torch.device("cpu"), stop=stop)
            start = time.perf_counter()
            trajectories, _ = run_episodes(engine, engines.environments, engines.conversation, samples, episode_rows)
            seconds = time.perf_counter() - start
            turns = sum(t.turns for t in trajectories)
            figures[kept].append((seconds, engine.prefill_tokens, turns))
            tokens[kept] = [t.tokens for t in trajectories]
    assert tokens[True] == tokens[False], "keeping the cache changed a trajectory"
    print(f"{len(samples)} trajectories, {figures[True][0][2]} turns, {args.rounds} interleaved rounds")
    print("| cache between turns | rollout s (median, range) | prefilled tokens | speed-up |")
    print("|---|---|---|---|")
    median = {kept: statistics.median(s for s, _, _ in runs) for kept, runs in figures.items()}
    for kept, runs in figures.items():
        seconds = [s for s, _, _ in runs]
        print(
            f"| {'kept' if kept else 're-prefilled'} | {median[kept]:.2f} ({min(seconds):.2f}-{max(seconds):.2f}) | "
            f"{runs[0][1]} | {median[False] / median[kept]:.2f}x |"
        )


if __name__ == "__main__":
    main()
