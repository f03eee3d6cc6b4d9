"""Why the language-model policies end at the reference loop's exact bits, on any CPU: the trainer's unit is a group
(`models.lm_rl`), each group's gradient is the same fp32 bits wherever it is computed, and groups add up in fp64,
so splitting a batch's groups over parts and devices in any arrangement gives the commit the same gradient as the
reference loop's one part. `make test` runs this on two kernel settings."""

import pytest
import torch

from dovetail.config.load import load_config
from dovetail.graph.node import SampleId
from dovetail.models.lm_rl import by_group
from dovetail.models.training import set_summed_gradient, weights_of
from dovetail.pipelines.lm.adapter import commit_scale
from dovetail.pipelines.lm.engines import LMEngines
from dovetail.pipelines.lm.messages import Decode, LMLogProbs, LMTrain, Prefill
from dovetail.pipelines.lm.model import encode_prompts, model_context
from dovetail.runtime.messages import Score

torch.set_num_threads(1)
PROMPTS, GROUP = 6, 4


@pytest.fixture(scope="module")
def step():
    """Engines on the sort task's model, one RL step's responses and scores, the reference log-probs (beta > 0
    makes the KL term part of the loss)."""
    config = load_config(
        None, ["kind=lm", "task=sort", f"algo.prompts_per_step={PROMPTS}", f"algo.group_size={GROUP}", "algo.beta=0.04"]
    )
    engines = LMEngines(config, torch.device("cpu"), True, None)
    ids = [SampleId(0, p, i) for p in range(PROMPTS) for i in range(GROUP)]
    prompts = encode_prompts(config, engines.tokenizer, engines.prompts.step(0), model_context(config))
    weights = weights_of(engines.trainer)
    started = engines.run(Prefill("sort", ids, [prompts[s.prompt] for s in ids], 0, weights))
    responses = engines.run(Decode("sort", [started], config.max_new_tokens, weights))
    scores = engines.run(Score("sort", [responses], None))
    assert len({len(t) for t in responses.tokens}) > 1, "ragged responses: groups pad to different widths"
    return engines, ids, responses, scores


def gradient(engines, parts: list[list[SampleId]], responses, scores) -> torch.Tensor:
    """The commit's gradient of the step trained as `parts` (each a list of whole groups), added in reverse order."""
    reference = [engines.run(LMLogProbs("sort", part, [responses], True)) for part in parts]
    trained, gradients = [], []
    for part in parts:
        trained.append(engines.run(LMTrain("sort", part, False, [responses], [scores], ref_log_probs=reference)))
        gradients.append(engines.part_gradient())
    set_summed_gradient(engines.trainer, gradients[::-1], commit_scale(trained))
    flat = torch.cat([p.grad.flatten() for p in engines.trainer.parameters()])
    engines.trainer.zero_grad(set_to_none=True)
    return flat


@pytest.mark.exactness
def test_any_split_of_the_groups_gives_the_reference_loops_gradient_bit_for_bit(step):
    engines, ids, responses, scores = step
    groups = by_group(ids)
    whole = gradient(engines, [ids], responses, scores)
    assert whole.abs().max() > 0
    for parts in (
        [[s for g in groups[:3] for s in g], [s for g in groups[3:] for s in g]],
        [[s for g in groups[::2] for s in g], [s for g in groups[1::2] for s in g]],
        [groups[5], [s for g in groups[:5] for s in g]],
        groups,
    ):
        assert torch.equal(gradient(engines, parts, responses, scores), whole)
