"""The planner decides exactly what it decided before it was made faster: on `plan_decisions.CASES`, every
policy's chosen shapes, every candidate its search simulated, its chosen plan's simulated trace (placements, times,
switches, steps, peak memory) and what `dovetail plan` prints equal the record `tests/data/plan_decisions.json` that
the code before issue 38's speed-ups made (2a751ff with the simulator's re-timing in a fixed order, `python
tests/plan_decisions.py`). This process's string hash seed is random, so the jigsaw cases' placements (ties at one
instant) also hold the trace to one order whatever the seed: before that fix, their spans changed from one process to
the next. A change that means to alter a decision regenerates the record and says why in its commit."""

import json
from pathlib import Path

import pytest
from plan_decisions import CASES, decisions, planned

RECORD = json.loads((Path(__file__).parent / "data" / "plan_decisions.json").read_text())


LARGEST = {("digen-wan-16", 16), ("digen-qwenimage-32", 32), ("jigsaw-64xa100", 64)}
"""The cases that take the most seconds: in `make test-slow`; each policy's search keeps a smaller case in the quick
tier (digen-flux-16, digen-qwenimage-32 on 8, jigsaw-mixed-0.6b-8b)."""


@pytest.mark.parametrize(
    ("name", "devices"),
    [pytest.param(*case, marks=pytest.mark.slow) if case in LARGEST else case for case in CASES],
    ids=[f"{name}@{devices}" for name, devices in CASES],
)
def test_plan_decides_what_it_decided_before(name: str, devices: int) -> None:
    assert decisions(name, devices) | {"plan": planned(name, devices)} == RECORD[f"{name}@{devices}"]
