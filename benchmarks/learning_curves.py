"""Learning curves too long for `make test` (each over ~30 s here): the reward rises under each algorithm.

    .venv/bin/python benchmarks/learning_curves.py [dance_grpo] [--out DIR]

* flow_grpo: FlowGRPO on the built-in digits model, 30 steps of the reference loop on digit_match: the held-out
  eval reward must rise by 0.1.
* dance_grpo: DanceGRPO (random 60 % of the timesteps per sample, shared group noise) on the built-in digits
  model, 30 steps of the reference loop: the held-out eval reward must rise by 0.1.
* sort: configs/sort.yaml (verl-sync on 2 CPU devices, B=32 x G=8) for 30 steps: the held-out success rate must
  rise by 0.05 (and the train reward of the last 5 steps beat the first 5's by 0.05).
* sort_ppo: the same with PPO and a critic (algo.advantage=gae, algo.micro_batches=1, critic.lr=1e-4): the same
  rises, and its final held-out success rate within 0.1 of GRPO's (the `sort` curve, run first when not asked for).

`make test` keeps one fast "it learns" test per kind (tests/test_train.py: FlowGRPO on brightness;
tests/test_runtime_lm.py: LM GRPO under verl-sync on short completions); DanceGRPO's math is tested against the
reference there too (tests/test_compat.py). Exits 1 if a curve does not rise as it should.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from dovetail import train
from dovetail.config.load import load_config


def flow_grpo(out: Path) -> tuple[float, float, float]:
    summary = train(load_config(None, ["eval.every=100", "checkpoint.every=100"]), out=out, steps=30)
    return summary["base_eval_reward"], summary["final_eval_reward"], 0.1


def dance_grpo(out: Path) -> tuple[float, float, float]:
    config = load_config(
        None, ["algorithm=dance_grpo", "algo.timestep_fraction=0.6", "eval.every=100", "checkpoint.every=100"]
    )
    summary = train(config, out=out, steps=30)
    return summary["base_eval_reward"], summary["final_eval_reward"], 0.1


def sort(out: Path) -> tuple[float, float, float]:
    return sort_curve(out, [])


PPO = ["algo.advantage=gae", "algo.micro_batches=1", "critic.lr=1e-4"]
"""PPO with a critic on configs/sort.yaml: GAE whitens over the whole step (one micro-batch)."""


def sort_ppo(out: Path) -> tuple[float, float, float]:
    base, final, rise = sort_curve(out, PPO)
    grpo = out.parent / "sort"
    if not (grpo / "summary.json").is_file():
        sort(grpo)
    grpo_final = json.loads((grpo / "summary.json").read_text())["final_eval_reward"]
    print(f"sort_ppo: final eval reward {final:.3f}, GRPO's {grpo_final:.3f}")
    if abs(final - grpo_final) > 0.1:
        print("sort_ppo: more than 0.1 from GRPO's")
        return base, -1.0, rise
    return base, final, rise


def sort_curve(out: Path, overrides: list[str]) -> tuple[float, float, float]:
    config = load_config("configs/sort.yaml", ["train.steps=30", "eval.every=30", "checkpoint.every=100", *overrides])
    summary = train(config, out=out, steps=30)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = (sum(m["reward/total"] for m in part) / 5 for part in (lines[:5], lines[-5:]))
    if last < first + 0.05:
        print(f"{out.name}: train reward {first:.3f} -> {last:.3f} over the first and last 5 steps (needs +0.05)")
        return summary["base_eval_reward"], -1.0, 0.05
    return summary["base_eval_reward"], summary["final_eval_reward"], 0.05


CURVES = {"flow_grpo": flow_grpo, "dance_grpo": dance_grpo, "sort": sort, "sort_ppo": sort_ppo}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curves", nargs="*", default=list(CURVES), help=f"any of {', '.join(CURVES)}")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    arguments = parser.parse_args()
    unknown = sorted(set(arguments.curves) - set(CURVES))
    if unknown:
        parser.error(f"unknown curve {unknown[0]!r}; known: {', '.join(CURVES)}")
    root = arguments.out or Path(tempfile.mkdtemp(prefix="dovetail-curves-"))
    failed = []
    for name in arguments.curves:
        start = time.perf_counter()
        base, final, rise = CURVES[name](root / name)
        verdict = "rises" if final >= base + rise else "DOES NOT RISE"
        seconds = time.perf_counter() - start
        print(f"{name}: eval reward {base:.3f} -> {final:.3f} ({verdict}; needs +{rise}), {seconds:.0f} s")
        if final < base + rise:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
