"""What the planner decides on a set of shipped scenarios, exactly: for each scenario, pool and policy, the shapes
it chose and the makespan of its simulated plan, a digest of every candidate its search simulated with its figures,
and digests of the chosen plan's simulated trace (every span's node, device, start and end: the placements and their
times; the switches, steps and peak memory). `tests/test_plan_decisions.py` checks today's code against a record of
these made by an earlier commit's, so a change meant only to make the planner faster (`benchmarks/planner_speed.py`)
cannot change a decision or a simulated second unnoticed.

    PYTHONPATH=<tree> python tests/plan_decisions.py [scenario@devices ...] > tests/data/plan_decisions.json

writes the record of `<tree>`'s code, of `CASES` or of the cases named."""

import hashlib
import json
import sys

from dovetail.cost.model import CostModel
from dovetail.plan.prepare import Searched, prepare, run_prepared
from dovetail.plan.report import allowed_policies, plan
from dovetail.plan.scenario import load_scenario
from dovetail.sched.policy import search_horizon

CASES = (
    ("digen-flux-16", 16),
    ("digen-qwenimage-32", 32),
    ("digen-qwenimage-32", 8),
    ("digen-wan-16", 16),
    ("calib-wan22-colocated", 8),
    ("jigsaw-64xa100", 64),
    ("jigsaw-mixed-0.6b-8b", 8),
    ("calib-nemorl-llama8b-16xh100", 16),
)
"""(scenario, devices): every pipeline kind, one pipeline and several, searching and fixed policies, 8 to 64 devices.
No pipeline here samples on its trainer (`sampler: trainer`), whose cost the DanceGRPO recipe's terms changed after
the record was made (`cost.model.CostModel.generate`)."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _figures(record: Searched) -> dict:
    """A candidate's shapes and figures, floats as their exact `repr`."""
    return {
        "shapes": repr(sorted(record.shapes.items())),
        "samples_per_s": repr(record.samples_per_s),
        "step_time_s": repr(record.step_time_s),
        "steady_step_s": repr(record.steady_step_s),
        "first_step_s": repr(record.first_step_s),
    }


def decisions(name: str, devices: int) -> dict:
    """Every allowed policy's plan of scenario `name` on `devices`, as `dovetail plan` makes it (one cost model for
    every policy, the run's steps up to the search horizon): its chosen shapes, the candidates its search simulated,
    and its chosen plan's trace (a digest of every span), or its refusal."""
    scenario = load_scenario(name)
    steps = search_horizon(scenario.schedule.steps)
    cost = CostModel(scenario.cluster.catalogue_device())
    result = {}
    for policy in allowed_policies(scenario):
        searched: list[Searched] = []
        try:
            prepared = prepare(scenario, policy, steps=steps, devices=devices, cost=cost, searched=searched)
        except ValueError as error:
            result[policy] = {"refused": str(error)}
            continue
        trace = run_prepared(scenario, prepared)
        spans = "\n".join(
            f"{s.node} {s.device} {s.start!r} {s.end!r} {s.share!r} {s.version} {s.work!r}" for s in trace.spans
        )
        result[policy] = {
            "shapes": repr(sorted(prepared.setup.shapes.items())),
            "makespan": repr(trace.makespan),
            "spans": _digest(spans),
            "switches": _digest(repr(trace.switches)),
            "steps": _digest(repr(trace.steps)),
            "peak_memory_gb": _digest(repr(trace.peak_memory_gb)),
            "candidates": len(searched),
            "searched": _digest(json.dumps([_figures(record) for record in searched])),
        }
    return result


def planned(name: str, devices: int) -> str:
    """A digest of what `dovetail plan` prints for scenario `name` on `devices` (every policy's candidates and figures
    to the printed digits, the best and why): the plan runs its policies together, sharing what they simulate alike."""
    return _digest(plan(load_scenario(name), devices))


def record(cases=CASES) -> dict:
    return {f"{name}@{devices}": decisions(name, devices) | {"plan": planned(name, devices)} for name, devices in cases}


if __name__ == "__main__":
    cases = [(arg.split("@")[0], int(arg.split("@")[1])) for arg in sys.argv[1:]] or CASES
    json.dump(record(cases), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
