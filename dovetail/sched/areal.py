"""`areal`: AReaL's fully asynchronous RL for LM GRPO (Fu et al., 2025).

Rollout and trainer pools are disaggregated. Rollout engines never wait for training: a new step
opens as soon as its rollouts would be at most `max_staleness` (eta) weight versions behind the
trainer, and each engine generates the oldest open step first. The trainer takes a step's batch once
every sample of it is scored, recomputes the log-probs of the current (proximal) policy in the
`logprob old` nodes — AReaL's decoupled PPO objective clips against this proximal policy and weights
by proximal / behaviour probabilities, so stale samples stay usable — then trains, commits and
publishes. The staleness of every trained batch is in the trace (`Metrics.staleness_histogram`).
Not modelled: AReaL interrupts running generations to load new weights mid-trajectory; here a step's
rollouts keep the version they started with, every draw of a step that draws more prompts (dynamic sampling,
`draws`: each after the score of the one before) too.
"""

from __future__ import annotations

from dovetail.sched.lm_common import SplitLMPolicy, step_done
from dovetail.sched.policy import View

ETA = 4
"""AReaL's default staleness bound (max_head_offpolicyness) in its GSM8K / math recipes."""


class Areal(SplitLMPolicy):
    name = "areal"
    max_staleness = ETA
    fixes = {"recompute_logprob": "recomputes the proximal policy's log-probs its decoupled objective needs"}

    def trainable(self, view: View, pipeline: str, step: int) -> bool:
        return step_done(view, pipeline, step, "score")
