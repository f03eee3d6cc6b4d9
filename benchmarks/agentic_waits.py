"""Free waits against held waits for one agentic pipeline alone on the 2 local devices, interleaved (free, held, then
held, free) so the two shapes meet the same load: the shape `env.free_waits` should default to is the one a lone
pipeline runs as fast in.

    .venv/bin/python benchmarks/agentic_waits.py [--pipeline calc-a] [--steps 6] [--out ...]

The pipeline is one of configs/multiplex-agentic.yaml's (its tool waits, its batch), run under `areal` and `verl-sync`
in each shape; a run's figure is its steps' mean `step_s` (benchmarks/multiplex.py's `pipeline_figures`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentic_multiplex import with_waits
from multiplex import finish, pipeline_figures, pipelines, run

ROOT = Path(__file__).resolve().parent.parent
ORDER = (("free", "held"), ("held", "free"))
"""The shapes of each round, in turn: each shape once first and once second."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "multiplex-agentic.yaml")
    parser.add_argument("--pipeline", default="calc-a")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-agentic-waits")
    args = parser.parse_args()
    configs = pipelines(args.steps, args.config)
    rows = []
    for round_, shapes in enumerate(ORDER):
        for waits in shapes:
            for policy in ("areal", "verl-sync"):
                config = with_waits(configs, waits == "free")[args.pipeline] | {"policy": policy}
                run_dir = args.out / f"{round_}-{waits}-{policy}"
                finish([run(config, run_dir)])
                rows.append({"round": round_, "waits": waits, "policy": policy, **pipeline_figures(run_dir)})
                print(f"round {round_}, {waits} waits, {policy}: {rows[-1]['step_s']:.3f} s/step", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
