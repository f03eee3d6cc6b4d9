"""How far the dry run's predicted step is from the step a user's model then takes, on this machine.

A user's model (a small Llama pretrained here briefly on "a+b=" sums, `benchmarks/user_lm.py`'s, so that it answers
in a few tokens of a 32-token budget) and its jsonl dataset, trained through `model.path` under a Ray policy on 2
CPU devices: `dovetail train --dry-run`'s steady step (profiled in-process, the simulator on those costs) beside the
run's measured steady step (its run_profile.json). Before a user's model decodes, the planner can only guess its
response lengths (half the budget); the start-up profile measures them, and both the dry run and the run price
those (`LMTrainConfig.profiled`).

    python benchmarks/dry_run_accuracy.py --out runs/dry-run-accuracy      # ~2 min on 2 CPU cores
"""

import argparse
import json
import time
from pathlib import Path

import torch
import yaml
from user_lm import dataset, pretrain, user_config

from dovetail import train
from dovetail.config.load import load_config
from dovetail.runtime.launch import dry_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/dry-run-accuracy"))
    parser.add_argument("--policy", default="verl-sync")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    train_file, test_file = dataset(args.out)
    model = pretrain(args.out / "my-llama", train_file, steps=60, seed=0)
    torch.set_num_threads(1)
    config = user_config(
        model,
        train_file,
        test_file,
        args.policy,
        args.steps,
        sampling={"max_new_tokens": 24},
        algo={"prompts_per_step": 64, "group_size": 8},
        eval={"prompts": 16, "every": 100},
        checkpoint={"every": 100},
        cluster={"devices": 2},
    )
    (args.out / "my_lm.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    loaded = load_config(args.out / "my_lm.yaml")
    guessed = loaded.scenario(args.steps).pipelines[0]
    plan = dry_run(loaded, args.steps)
    start = time.perf_counter()
    train(loaded, out=args.out / "run", overwrite=True)
    profile = json.loads((args.out / "run" / "run_profile.json").read_text())
    measured = profile["measured_steady_step_s"]
    print(
        f"{args.policy}: dry run {plan['steady_step_s']:.3f} s/step, run {measured:.3f} s/step "
        f"(predicted / measured {plan['steady_step_s'] / measured:.2f}; responses guessed before decoding: median "
        f"{guessed.lengths.median} tokens; run {time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
