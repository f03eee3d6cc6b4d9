"""DAPO's dynamic sampling (arXiv 2503.14476, section 3.2) as the reference loop and verl-sync share it: a step draws
batches of B = algo.prompts_per_step prompts (draw d holds positions d·B to d·B + B - 1 of the step,
`RunPrompts.train`), drops the groups whose rewards are all equal (their GRPO advantages are 0) and draws again
until B groups differ or algo.dynamic_sampling_max_draws batches were drawn (DAPO's max_num_gen_batches). The step
trains the first B groups that differ by prompt position (fewer where the draws ran out; where none differs, the first
draw's). What was drawn and what is kept is a function of the draws' scores alone, so the reference loop and a Ray
policy, whose score nodes answer in another order, keep the same groups.
"""

from __future__ import annotations

import numpy as np

from dovetail.graph.node import SampleId
from dovetail.runtime.messages import Scores


def informative_samples(scores: Scores) -> list[SampleId]:
    """The samples of the groups whose total rewards are not all equal, in order."""
    totals: dict[tuple[int, int], list[float]] = {}
    for sample, total in zip(scores.samples, scores.scores["total"].tolist()):
        totals.setdefault((sample.step, sample.prompt), []).append(total)
    return [s for s in scores.samples if len(set(totals[(s.step, s.prompt)])) > 1]


def enough(drawn: list[Scores], prompts_per_step: int) -> bool:
    """Whether the draws scored so far hold a batch of groups that differ: no further draw is needed."""
    groups = {(s.step, s.prompt) for scores in drawn for s in informative_samples(scores)}
    return len(groups) >= prompts_per_step


def kept_samples(drawn: list[Scores], prompts_per_step: int) -> list[SampleId]:
    """The samples the step trains, out of the scores of every draw it made: the first `prompts_per_step` groups
    that differ by prompt position, each group's samples in index order; where no group differs, the first draw's."""
    informative = sorted(SampleId(*s) for scores in drawn for s in informative_samples(scores))
    prompts = sorted({s.prompt for s in informative})[:prompts_per_step]
    if not prompts:
        return sorted(SampleId(*s) for scores in drawn for s in scores.samples if s.prompt < prompts_per_step)
    chosen = set(prompts)
    return [s for s in informative if s.prompt in chosen]


def dynamic_sampling_metrics(drawn: list[Scores], kept: list[SampleId], prompts_per_step: int) -> dict[str, float]:
    """`dynamic_sampling/draws`: the batches drawn; `dynamic_sampling/groups`: the groups that differ kept, over B;
    `dynamic_sampling/dropped`: the groups drawn whose rewards were all equal."""
    scored = {(s.step, s.prompt) for scores in drawn for s in scores.samples}
    informative = {(s.step, s.prompt) for scores in drawn for s in informative_samples(scores)}
    kept_informative = {(s.step, s.prompt) for s in kept} & informative
    return {
        "dynamic_sampling/draws": float(sum(1 for scores in drawn if scores.samples)),
        "dynamic_sampling/groups": len(kept_informative) / prompts_per_step,
        "dynamic_sampling/dropped": float(len(scored - informative)),
    }


def scores_of(parts: list[Scores], samples: list[SampleId]) -> Scores:
    """The scores of `samples`, in their order, out of `parts` (a language model's: each has its response lengths)."""
    where = {sample: (part, row) for part in parts for row, sample in enumerate(part.samples)}
    rows = [where[s] for s in samples]
    return Scores(
        list(samples),
        {name: np.array([part.scores[name][row] for part, row in rows]) for name in parts[0].scores},
        np.array([np.asarray(part.response_tokens)[row] for part, row in rows]),
        {name: np.array([part.figures[name][row] for part, row in rows]) for name in parts[0].figures},
    )
