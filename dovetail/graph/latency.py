"""How long an environment's step or a tool call takes, as the trajectory waiting on it sees it: one shape for the
run config (`env.latency`, a tool's `latency`), the runtime that waits it out (`dovetail.envs`) and the planner that
prices it (`graph.spec.TurnsSpec`), so a wait is drawn the same wherever it is drawn."""

import functools
import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dovetail.graph.node import sample_key

MAX_WAIT_S = 3600.0
"""The longest wait a latency gives: a lognormal's tail is cut there, so one draw cannot stall a run for a day."""


class Latency(BaseModel):
    """How long a tool call or an environment's step takes, as the trajectory waiting on it sees it: `constant`
    (`seconds` each time) or `lognormal` (`median_s`, and `sigma` the spread of log(wait): most waits short, a few
    long, as sandboxes and APIs are). Each wait is drawn by `draw` from a generator keyed by who waits, never by a
    process's RNG, so a run waits the same every time it runs, in whatever process. It is a config section:
    ``{kind: constant, seconds: 0.2}`` or ``{kind: lognormal, median_s: 0.5, sigma: 0.8}``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    kind: Literal["constant", "lognormal"] = "constant"
    seconds: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="constant: every wait, in seconds")
    median_s: float | None = Field(None, gt=0, le=MAX_WAIT_S, description="lognormal: the median wait, in seconds")
    sigma: float | None = Field(
        None, ge=0, le=4, description="lognormal: the standard deviation of log(wait); beyond 4 the tail is all"
    )

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> "Latency":
        if self.kind == "constant" and (self.median_s is not None or self.sigma is not None):
            raise ValueError("median_s and sigma are a lognormal latency's: set kind: lognormal, or give seconds alone")
        if self.kind == "lognormal" and (self.median_s is None or self.sigma is None or self.seconds):
            raise ValueError(
                "a lognormal latency takes median_s and sigma, not seconds: e.g. {kind: lognormal, median_s: 0.5, "
                "sigma: 0.8}"
            )
        return self

    def draw(self, *identity: int | str) -> float:
        """Seconds of one wait: the same for the same `identity` (the run's seed, the trajectory's SampleId, the
        turn, what waits), whatever process draws it. The runtime decides how to wait them; nothing here sleeps."""
        if self.kind == "constant":
            return self.seconds
        assert self.median_s is not None and self.sigma is not None  # the validator holds them for a lognormal
        return min(self.median_s * math.exp(self.sigma * _standard_normal(identity)), MAX_WAIT_S)


@functools.lru_cache(maxsize=1 << 16)
def _standard_normal(identity: tuple[int | str, ...]) -> float:
    """One standard normal draw keyed by `identity`, remembered: the planner prices the same trajectories' waits in
    every cut it weighs (a split policy's trainer sizes, `what_fits`'s pools), and seeding a generator per wait was
    most of a plan's time on an agentic scenario."""
    return random.Random(sample_key("latency", *identity)).gauss(0.0, 1.0)


NO_LATENCY = Latency()
