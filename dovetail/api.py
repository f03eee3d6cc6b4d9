"""The Python API: `dovetail.train(config, ...)` and `dovetail.simulate(scenario, ...)`, as the command line's
`dovetail train` and `dovetail simulate --json` do them. Imports nothing heavy until called."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the API imports nothing heavy until called
    from dovetail.request import Callback


def train(
    config,
    *,
    out: Path | str | None = None,
    overrides: Sequence[str] = (),
    steps: int | None = None,
    resume: Path | str | None = None,
    overwrite: bool = False,
    callbacks: Sequence[Callback] = (),
) -> dict:
    """Train as `dovetail train` does and return the run's summary (what summary.json holds).

    `config`: a YAML path, a dict of config sections (as the YAML would hold them), or a config object
    (`dovetail.config.load.load_config`); `overrides` dotted like the command line's (`["train.lr=1e-4"]`).
    `callbacks`: objects with `on_step(metrics, pipeline)` (each metrics.jsonl line) and / or
    `on_eval(evaluation, pipeline)` (`dovetail.trackers.Evaluation`, the base evaluation at step 0 included).
    `out`: the run directory; default runs/latest, or with `resume` the resumed run's own (another `out` continues a
    copy there, as the command line's `--resume` does). A bad config raises `dovetail.config.common.ConfigError`; a
    directory holding another run `RunDirInUse` (unless `overwrite`); Ctrl-C stops after the step in flight, saved,
    raising `dovetail.run_dir.RunInterrupted`."""
    from dovetail.request import RunRequest
    from dovetail.runner import train as run_training

    request = RunRequest.build(
        config, overrides, out=out, steps=steps, resume=resume, overwrite=overwrite, callbacks=callbacks
    )
    return run_training(request)


def simulate(scenario, policies: list[str] | None = None, *, steps: int | None = None) -> dict:
    """Simulate policies on a scenario as `dovetail simulate --json` does and return that object: per policy its
    step time, throughput, efficiency, bubbles, staleness, memory, and the speed-up over the first policy.

    `scenario`: a shipped scenario's name (`dovetail simulate --list`), a YAML path, or a scenario object
    (`dovetail.plan.scenario.load_scenario`); `policies`: default the scenario's schedule.policies."""
    from dovetail.plan.report import compare
    from dovetail.plan.scenario import Scenario, load_scenario

    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    return compare(scenario, policies, steps=steps)
