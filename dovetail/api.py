"""The Python API: `dovetail.train(config, ...)` and `dovetail.simulate(scenario, ...)`, as the command line's
`dovetail train` and `dovetail simulate --json` do them. Imports nothing heavy until called."""

from pathlib import Path


def train(
    config,
    *,
    out: Path | str | None = None,
    overrides: list[str] = (),
    steps: int | None = None,
    resume: Path | str | None = None,
    overwrite: bool = False,
    callbacks: list = (),
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
    import copy

    from dovetail.config.load import apply_override, load_config, parse_config
    from dovetail.runner import train as run_training

    if isinstance(config, str | Path):
        config = load_config(config, list(overrides))
    else:  # a tree, or a config object: validated again, with the overrides applied
        tree = copy.deepcopy(config) if isinstance(config, dict) else config.model_dump(mode="json")
        for override in overrides:
            apply_override(tree, override)
        config = parse_config(tree)
    if out is None:
        from dovetail.run_dir import run_of

        out = run_of(Path(resume)) if resume is not None else Path("runs/latest")
    return run_training(config, Path(out), steps=steps, resume=resume, overwrite=overwrite, callbacks=list(callbacks))


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
