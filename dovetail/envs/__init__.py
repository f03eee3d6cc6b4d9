"""Environments and tools for multi-turn rollouts (docs/environments.md): the contract a user implements
(`contract.py`: `Environment`, `Turn`, `StepResult`, `Tool`, `Latency`), how tool calls are written and answered
(`toolcalls.py`: the `hermes` and `plain` parsers, tools offered through a chat template), the built-in tools
(`tools.py`: calculator, sandboxed Python in `sandbox.py`, lookup), the built-in environments (`arithmetic.py`,
`lookup.py`), one trajectory's episode (`episode.py`) and episodes run out of the caller's process with a time limit
(`host.py`).

An environment is named as a reward is: a built-in by its name (`ENVIRONMENTS`), your own as "package.module:Class",
imported when the config is read (`environment_class`). The reference loop runs an env config's multi-turn rollouts
(`pipelines.lm.multiturn`); the Ray policies' are the next part of issue 36."""

import inspect

from dovetail.envs.contract import Environment, Latency, StepResult, Tool, ToolCall, Turn
from dovetail.rewards import import_named
from dovetail.rewards.process import describe

__all__ = ["Environment", "Latency", "StepResult", "Tool", "ToolCall", "Turn", "environment_class", "make_environment"]

ENVIRONMENTS: dict[str, str] = {
    "arithmetic": "dovetail.envs.arithmetic:Arithmetic",
    "lookup": "dovetail.envs.lookup:KeyLookup",
}
"""The built-in environments by name: "module:Class" paths, imported on first use."""


def environment_class(name: str) -> type[Environment]:
    """A built-in environment by name, or your own "package.module:Class" (a subclass of `Environment`), imported;
    anything else is a ValueError in one line saying what to write."""
    if name not in ENVIRONMENTS and ":" not in name:
        raise ValueError(
            f"unknown environment {name!r}; use a built-in ({', '.join(sorted(ENVIRONMENTS))}) or your own as "
            "package.module:Class"
        )
    found = import_named(ENVIRONMENTS.get(name, name), "environment")
    if not (isinstance(found, type) and issubclass(found, Environment)):
        attribute = name.rpartition(":")[2]
        raise ValueError(
            f"environment {name!r} is a {type(found).__name__}, not an Environment: write class {attribute}"
            "(dovetail.envs.Environment) with reset(row) and step(turn)"
        )
    if inspect.isabstract(found):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise ValueError(f"environment {name!r} does not define {missing}: an Environment answers reset and step")
    return found


def check_options(name: str, options: dict) -> type[Environment]:
    """Environment `name`'s class, having checked that its constructor takes `options` as keyword arguments without
    making one (a constructor may load data): what a config is checked for as it is read."""
    found = environment_class(name)
    try:
        inspect.signature(found).bind(**options)
    except TypeError as error:
        raise ValueError(f"environment {name!r} does not take these options: {error}") from None
    return found


def make_environment(name: str, options: dict) -> Environment:
    """A new instance of environment `name` (one per trajectory) made with `options`; a constructor that raises is a
    ValueError naming the environment."""
    found = check_options(name, options)
    try:
        return found(**options)
    except Exception as error:
        raise ValueError(f"environment {name!r} could not be made from its options: {describe(error)}") from None
