"""How the tests start a run: as `dovetail.train` does (a `RunRequest` built and checked, then the runner), with the
Ray runtime's fault-injection hooks (`after_start`, `after_part`) where a test injects a fault."""

from pathlib import Path

from dovetail import runner
from dovetail.request import FaultHooks, RunRequest


def train(config, out: Path, *, after_start=None, after_part=None, **request) -> dict:
    """Train `config` into `out`; `request` as `RunRequest.build` takes it (steps, resume, overwrite, callbacks...)."""
    hooks = FaultHooks(after_start=after_start, after_part=after_part)
    return runner.train(RunRequest.build(config, out=out, hooks=hooks, **request))
