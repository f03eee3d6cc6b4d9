"""The fault-injection kill matrix: every moment x {one worker, two close together, every worker} of a 3-step digen
run on 2 local devices, each compared bit for bit with an undisturbed run.

    .venv/bin/python benchmarks/kill_matrix.py [--out runs/kill-matrix]

Moments and spreads are tests/fault_injection.py's. Prints one markdown row per cell: the kills made, the restarts
the run recorded, the ledger's problems (samples lost or trained twice), whether the weights are bitwise the
undisturbed run's, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fault_injection import CONFIG, MOMENTS, SPREADS, Fault  # noqa: E402

from dovetail import runner  # noqa: E402
from dovetail.config.load import load_config  # noqa: E402
from dovetail.request import FaultHooks, RunRequest  # noqa: E402
from dovetail.runtime.ray_start import start_local_ray  # noqa: E402

STEPS = 3


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "kill-matrix")
    parser.add_argument("--moments", nargs="*", default=list(MOMENTS), help="a subset of the moments")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start_local_ray(cpu_devices=2)
    runner.train(RunRequest.build(load_config(None, CONFIG), out=args.out / "undisturbed", steps=STEPS))
    expected = weights(args.out / "undisturbed")
    print("| moment | workers killed | kills | restarts | ledger problems | weights bitwise equal | wall s |")
    print("|---|---|---|---|---|---|---|")
    for moment in args.moments:
        for spread in SPREADS:
            out = args.out / f"{moment.replace(' ', '-')}-{spread.replace(' ', '-')}"
            fault = Fault(moment, spread, STEPS)
            start = time.perf_counter()
            request = RunRequest.build(
                load_config(None, CONFIG), out=out, steps=STEPS, hooks=FaultHooks(**fault.hooks())
            )
            summary = runner.train(request)
            took = time.perf_counter() - start
            problems = json.loads((out / "ledger.json").read_text())["problems"]
            got = weights(out)
            equal = all(torch.equal(got[k], expected[k]) for k in expected)
            kills = ", ".join(f"{label} d{device}" for label, device in fault.killed)
            print(
                f"| {moment} | {spread} | {kills} | {summary['restarts']} | {len(problems)} | {equal} | {took:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
