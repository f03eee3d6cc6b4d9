"""Learning curves too long for `make test` (each over ~30 s here): the reward rises under each algorithm.

    .venv/bin/python benchmarks/learning_curves.py [dance_grpo] [--out DIR]

* dance_grpo: DanceGRPO (random 60 % of the timesteps per sample, shared group noise) on the built-in digits
  model, 30 steps of the reference loop: the held-out eval reward must rise by 0.1.

`make test` keeps one fast "it learns" test per kind (tests/test_train.py: FlowGRPO; tests/test_runtime_lm.py: LM
GRPO under verl-sync); DanceGRPO's math is tested against the reference there too (tests/test_compat.py). Exits 1
if a curve does not rise as it should.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

from dovetail.config.train import load_config
from dovetail.train import train


def dance_grpo(out: Path) -> tuple[float, float, float]:
    config = load_config(
        None, ["algorithm=dance_grpo", "algo.timestep_fraction=0.6", "eval.every=100", "checkpoint.every=100"]
    )
    summary = train(config, out, steps=30)
    return summary["base_eval_reward"], summary["final_eval_reward"], 0.1


CURVES = {"dance_grpo": dance_grpo}


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
