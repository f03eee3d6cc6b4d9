"""Trainer-side pieces of GRPO for language models: the log-probs of sampled responses under the policy, and
the gradient of a set of groups.

The rollout engine records log softmax(logits / temperature)[token] for every token it samples; the
trainer recomputes the same quantity here with the Hugging Face model, under grad, so that on-policy
the GRPO ratio is exactly 1 (up to fp32 rounding; tested against `TorchEngine`).

The unit of trainer work is a group (the responses to one prompt): log-probs and gradients are computed one
group at a time, each group padded to its own longest response, and the groups' gradients are added in fp64.
A group's fp32 gradient is then the same bits whichever device, part or batch it is computed in, and adding
fp32 terms in fp64 is exact unless their magnitudes span more than 2^29, so the sum rounded once to fp32 does
not depend on how the runtime split the batch into parts and devices: the reference loop and every synchronous
policy end at the same bits on any CPU, whatever kernels it picks (a whole-batch backward would sum the rows in
an order its kernel chooses by shape). Groups of one prompt are also faster here than one padded batch, and a group
passes its prompt once (`group_response_log_probs`), not once per response.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import groupby

import numpy as np
import torch

from dovetail.algo import (
    advantages,
    clipped_value_loss,
    decoupled_old_log_prob,
    gae_advantages_returns,
    lm_grpo_loss,
    rollout_correction_weight,
)
from dovetail.algo.lm_grpo import kl_estimate
from dovetail.algo.reward_shaping import overlong_penalty, sequence_kl
from dovetail.graph.node import SampleId
from dovetail.models.engine import CACHE, Request
from dovetail.models.training import compute_device, flat_gradient, trainable_parameters


def pad_batch(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ids (B, L) and a bool mask (B, L) of the real tokens.

    Right padding keeps every real token at its unpadded position (0, 1, ...), so the model needs no
    position ids and the logits of a sequence do not depend on what it is batched with."""
    width = max(map(len, sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        mask[row, : len(sequence)] = True
    return ids, mask


def response_log_probs(
    model, prompts: list[list[int]], responses: list[list[int]], temperature: float, entropy: bool = False
):
    """log softmax(logits / temperature)[token] of every response token given its prompt, in one batched
    forward of `model` (a causal LM returning `.logits`); gradients flow when called under grad.

    Returns (log_probs, mask), both (B, R) with R the longest response: log_probs[b, i] belongs to
    responses[b][i] where mask[b, i], and is 0 elsewhere. With `entropy`, also the entropy (B, R) of each response
    position's distribution, softmax(logits / temperature), the one its token was sampled from (0 on padding; under
    grad where the log-probs are)."""
    device = compute_device(model)
    ids, attention_mask = pad_batch([p + r for p, r in zip(prompts, responses)])
    logits = model(input_ids=ids.to(device), attention_mask=attention_mask.long().to(device), use_cache=False).logits
    targets, mask = pad_batch(responses)
    targets, mask = targets.to(device), mask.to(device)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    # The logits at position i predict token i + 1: response token j is predicted at prompt_length - 1 + j.
    predicting = prompt_lengths[:, None] - 1 + torch.arange(targets.shape[1], device=device)
    predicting = predicting.clamp(max=logits.shape[1] - 1)  # padding columns: any valid row, masked below
    picked = logits.gather(1, predicting[..., None].expand(-1, -1, logits.shape[-1]))
    return _token_log_probs(picked, targets, mask, temperature, entropy)


def group_response_log_probs(
    model, prompt: list[int], responses: list[list[int]], temperature: float, entropy: bool = False
):
    """`response_log_probs` of responses to one prompt (a GRPO group), the prompt passed once instead of once per
    response: a forward of the prompt alone keeps its keys and values, the responses read them from that cache as
    one right-padded batch, and a backward adds every response's gradient through the one prompt pass. The same
    log-probs up to fp32 rounding, with G - 1 fewer passes over the prompt forward and back (the shared-prefix
    forward of "Prefix Grouper", Liu et al. 2025): a group's G copies of a long prompt are most of its tokens.
    Right padding needs no attention mask: a real token attends to the prompt and the tokens before it only."""
    device = compute_device(model)
    targets, mask = pad_batch(responses)
    targets, mask = targets.to(device), mask.to(device)
    prompt_pass = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
    logits = prompt_pass.logits.expand(len(responses), 1, -1)  # the last prompt position: each first token
    if targets.shape[1] > 1:  # response token j > 0 is predicted at the response's position j - 1
        cache = getattr(prompt_pass, CACHE)
        cache.batch_repeat_interleave(len(responses))
        rest = model(input_ids=targets[:, :-1], use_cache=True, **{CACHE: cache}).logits
        logits = torch.cat([logits, rest], dim=1)
    return _token_log_probs(logits[:, : targets.shape[1]], targets, mask, temperature, entropy)


def _token_log_probs(logits, targets, mask, temperature: float, entropy: bool):
    """The log-probs (and with `entropy` the entropies) of `targets` (B, R) under the logits (B, R, V) that predict
    them, 0 where `mask` is not."""
    distributions = (logits / temperature).log_softmax(-1)
    log_probs = distributions.gather(-1, targets[..., None]).squeeze(-1).masked_fill(~mask, 0.0)
    if not entropy:
        return log_probs, mask
    entropies = -(distributions.exp() * distributions).sum(-1)
    return log_probs, mask, entropies.masked_fill(~mask, 0.0)


def group_prompt(requests: list[Request]) -> list[int]:
    """The one prompt a group's requests answer."""
    prompt = requests[0].prompt
    if any(request.prompt != prompt for request in requests):
        raise ValueError(f"a group's requests answer different prompts: {[r.key for r in requests]}")
    return prompt


def by_group(samples: Iterable[SampleId]) -> list[list[SampleId]]:
    """`samples` cut into their groups (same step and prompt), in key order."""
    return [list(members) for _, members in groupby(sorted(samples), key=lambda s: (s.step, s.prompt))]


def lockstep_log_probs(model, prompt: list[int], responses: list[list[int]], temperature: float, entropy: bool = False):
    """`group_response_log_probs` as a member of an FSDP group computes it: in one forward, the prompt repeated per
    response (`response_log_probs`). Every forward of a sharded model gathers each block's parameters from every
    member, so the members must make the same calls; the prompt pass's cache is read by a second call only where a
    response has more than one token, which would make the calls depend on the member's responses."""
    return response_log_probs(model, [prompt] * len(responses), responses, temperature, entropy)


def padding_pass(model) -> torch.Tensor:
    """The loss of a pass with nothing to train, times 0: what a member of an FSDP group runs (forward, and backward
    when training) where it has fewer groups than the others, so that every member makes the step's gathers and
    reductions; it adds exact zeros to the gradients."""
    log_probs, _ = response_log_probs(model, [[0]], [[0]], 1.0)
    return log_probs.sum() * 0.0


def group_log_probs(
    model, requests: dict[SampleId, Request], temperature: float, passes: int | None = None
) -> dict[SampleId, torch.Tensor]:
    """Each sampled response's log-probs (`group_response_log_probs`, a group at a time), without grad. `passes`: the
    forwards every member of a sharded trainer's group makes (`lockstep_log_probs`, then `padding_pass`es); None for
    a replica."""
    out: dict[SampleId, torch.Tensor] = {}
    groups = by_group(requests)
    log_probs_of = group_response_log_probs if passes is None else lockstep_log_probs
    with torch.no_grad():
        for group in groups:
            chosen = [requests[s] for s in group]
            log_probs, mask = log_probs_of(model, group_prompt(chosen), [r.tokens for r in chosen], temperature)
            out |= {s: row[m] for s, row, m in zip(group, log_probs, mask)}
        for _ in range(_padding(groups, passes)):
            padding_pass(model)
    return out


def _padding(groups: list, passes: int | None) -> int:
    """How many padding passes a member with `groups` makes to make `passes` in all."""
    if passes is None:
        return 0
    if len(groups) > passes:
        raise ValueError(f"{len(groups)} groups in a part of {passes} lockstep passes: the driver counts them")
    return passes - len(groups)


def accumulate_group_gradients(
    model, samples: Sequence[SampleId], group_loss: Callable[[list[SampleId]], tuple[torch.Tensor, dict] | None]
) -> tuple[torch.Tensor, list[dict]]:
    """Backpropagate `group_loss(group)` for every group of `samples`, one group at a time, and return the flat
    sum of their gradients over the trainable parameters in fp64 (the model's own gradients are left cleared) and
    each group's statistics. `group_loss` returns (loss, stats), or None for a group with nothing to train."""
    trained = trainable_parameters(model)
    total = torch.zeros(sum(p.numel() for p in trained), dtype=torch.float64, device=trained[0].device)
    stats = []
    for group in by_group(samples):
        model.zero_grad(set_to_none=True)
        result = group_loss(group)
        if result is None:
            continue
        loss, group_stats = result
        loss.backward()
        total += flat_gradient(model)
        stats.append(group_stats | {"loss": loss.item()})
    model.zero_grad(set_to_none=True)
    return total, stats


def backward_in_lockstep(
    model,
    samples: Sequence[SampleId],
    group_loss: Callable[[list[SampleId]], tuple[torch.Tensor, dict | None]],
    passes: int,
    padding: Callable[[torch.nn.Module], torch.Tensor] = padding_pass,
) -> list[dict]:
    """`accumulate_group_gradients` on a member of a sharded trainer's FSDP group: each group's loss backpropagated
    into the model's own gradients, where FSDP adds every member's into each member's shard, and `padding` passes
    (the policy's `padding_pass`, a critic's `value_padding_pass`) up to `passes`, the count every member makes.
    `group_loss` gives a group with nothing to train a loss of 0 and no statistics: its backward still runs. Returns
    each trained group's statistics."""
    groups = by_group(samples)
    stats = []
    for group in groups:
        loss, group_stats = group_loss(group)
        loss.backward()
        if group_stats is not None:
            stats.append(group_stats | {"loss": loss.item()})
    for _ in range(_padding(groups, passes)):
        padding(model).backward()
    return stats


def sampled_mask(like: torch.Tensor, generated: Sequence[Sequence[bool]]) -> torch.Tensor:
    """Row b's first len(generated[b]) positions set where the model sampled the token, padded with False to the
    (B, R) shape of `like`."""
    sampled = torch.zeros_like(like, dtype=torch.bool)
    for row, flags in enumerate(generated):
        sampled[row, : len(flags)] = torch.as_tensor(list(flags), dtype=torch.bool)
    return sampled


def normaliser_of(aggregation: str, max_new_tokens: int, mask: torch.Tensor) -> float:
    """What a part of the step adds to the step's loss normaliser: its tokens (token aggregation, DAPO), its
    sequences (GRPO), or its sequences x max_new_tokens (Dr. GRPO)."""
    if aggregation == "token":
        return float(mask.sum())
    sequences = float(mask.shape[0])
    return sequences if aggregation == "sequence" else sequences * max_new_tokens


def policy_gradient(
    model,
    requests: dict[SampleId, Request],
    rewards: dict[SampleId, float],
    old_log_probs: dict[SampleId, object],
    ref_log_probs: dict[SampleId, object],
    *,
    algo,
    temperature: float,
    max_new_tokens: int,
    stale: bool,
    passes: int | None = None,
    generated: dict[SampleId, Sequence[bool]] | None = None,
    scored_requests: dict[SampleId, Request] | None = None,
    values: dict[SampleId, object] | None = None,
    first_update: Mapping[SampleId, object] | None = None,
    keep_log_probs: dict[SampleId, np.ndarray] | None = None,
) -> tuple[torch.Tensor | None, list[dict], float]:
    """The GRPO gradient of the groups of `requests` (a part of the step, whole groups), summed: the flat fp64
    gradient of the loss summed over the part (`lm_grpo_loss(loss_scale=1)`), each group's statistics, and what
    the part adds to the step's normaliser (the commit divides the summed parts by the step's).

    Advantages are estimated from `rewards` (every scored sample of the micro-batch, the step's with one) by the
    registered `algo.advantage` (`step_advantages`): a group-wise estimator needs only each group's members, a
    whole-batch one every response of the step. `scored_requests` holds every scored sample's request (its length,
    the engine's log-probs), which the reward shaping and whole-batch estimators read; None: `requests`, the part's.

    Old log-probs are the recomputed ones given in `old_log_probs`, or on policy (none given: one optimizer step per
    batch) the trainer's own, detached, so the ratio is 1 — as TRL and verl skip that pass. Where they are given (an
    engine whose log-probs are not the trainer's: vLLM) the mean absolute gap between them and the engine's is
    reported as `logprob_gap`, and each token's surrogate is weighted by `algo.rollout_correction` of their ratio
    (TIS / MIS; an engine that matches the trainer needs none). A stale part (rollouts of an older version) is
    corrected by the decoupled PPO weight of the proximal to the behaviour log-probs. The mean token entropy of the
    sampling distributions is reported, and with `algo.entropy_coef` its bonus trains (the loss less entropy_coef x
    the entropy, aggregated as the surrogate). `algo`: the run's `algo` section (estimator, loss, clips,
    aggregation, KL, entropy bonus, shaping).

    `passes`: on a member of a sharded trainer's group, the passes every member makes (`backward_in_lockstep`): the
    gradient is then left in the model's own (its shard of every member's), and None is returned for it.

    `ref_log_probs` empty: no KL term, where the step has no reference pass (beta = 0, or the start-up profile's
    train, which times the pass without one).

    `generated`: multi-turn trajectories' masks, per response token whether the model sampled it. The others are the
    environment's observations: the whole trajectory is passed (each model turn reads the observations before it),
    and only the sampled tokens enter the loss, its normaliser, the KL, the entropy and the statistics.

    `values`: with `algo.advantage: gae`, the critic's value of every token of every scored sample (`group_values`),
    from which each token's advantage is estimated (`step_gae`); the surrogate then weighs each token by its own.

    Several updates on one batch (algo.num_iterations): the first passes `keep_log_probs`, which receives each
    response's log-probs under the weights it trains (detached, as the first update's old ones); a later update
    passes them back as `first_update`, where they take the place of the trainer's own: the old policy stays the one
    that sampled, so the ratio moves from 1 and the clip acts (as TRL's num_iterations and verl's ppo_epochs, whose
    old log-probs are computed once before the updates). A stale part's proximal policy is then that first one."""
    scored = requests if scored_requests is None else scored_requests
    advantage_of: Mapping[SampleId, object]
    if algo.advantage == "gae":
        assert values is not None, "gae's advantages read the critic's values"
        gae = step_gae(
            rewards,
            scored,
            values,
            old_log_probs,
            ref_log_probs,
            algo=algo,
            max_new_tokens=max_new_tokens,
            generated=generated,
        )
        advantage_of = {s: per_token for s, (per_token, _) in gae.items()}
    else:
        advantage_of = step_advantages(
            rewards,
            scored,
            old_log_probs,
            ref_log_probs,
            algo=algo,
            max_new_tokens=max_new_tokens,
            generated=generated,
        )
    normaliser = 0.0

    def group_loss(group: list[SampleId]):
        nonlocal normaliser
        group_requests = [requests[s] for s in group]
        responses = [r.tokens for r in group_requests]
        log_probs_of = group_response_log_probs if passes is None else lockstep_log_probs
        log_probs, mask, entropy = log_probs_of(model, group_prompt(group_requests), responses, temperature, True)
        if generated:
            mask = mask & sampled_mask(mask, [generated[s] for s in group])
        if algo.entropy_coef == 0:
            entropy = entropy.detach()  # the metric alone: no backward through it
        normaliser += normaliser_of(algo.aggregation, max_new_tokens, mask)
        if not mask.any():  # a member of a sharded group backpropagates it all the same (`backward_in_lockstep`)
            return None if passes is None else (log_probs.sum() * 0.0, None)

        def padded(per_sample: Mapping) -> torch.Tensor:
            out = torch.zeros_like(log_probs)
            for row, sample in enumerate(group):
                values = torch.as_tensor(np.asarray(per_sample[sample]), dtype=log_probs.dtype)
                out[row, : len(values)] = values.to(out.device)
            return out

        if keep_log_probs is not None:
            for row, (sample, request) in enumerate(zip(group, group_requests)):
                keep_log_probs[sample] = log_probs[row, : len(request.tokens)].detach().cpu().numpy()
        own = padded(first_update) if first_update else log_probs.detach()
        old = padded(old_log_probs) if old_log_probs else own
        weight = None
        if old_log_probs and algo.rollout_correction != "none":  # the engine's log-probs are not the trainer's
            engine = padded({s: r.log_probs for s, r in zip(group, group_requests)})
            weight = rollout_correction_weight(old, engine, algo.rollout_correction, algo.rollout_correction_cap)
        if stale:
            behaviour = padded({s: r.log_probs for s, r in zip(group, group_requests)})
            old, stale_weight = decoupled_old_log_prob(own, behaviour, max_weight=algo.stale_max_weight)
            weight = stale_weight if weight is None else weight * stale_weight
        if algo.advantage == "gae":
            group_advantages = padded({s: advantage_of[s] for s in group})
        else:
            group_advantages = torch.tensor([advantage_of[s] for s in group], device=log_probs.device)
        loss, stats = lm_grpo_loss(
            log_probs,
            old,
            group_advantages,
            mask,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            policy_loss=algo.loss,
            aggregation=algo.aggregation,
            max_tokens=max_new_tokens,
            ref_log_probs=padded(ref_log_probs) if ref_log_probs else None,
            beta=algo.beta if algo.kl_in == "loss" and ref_log_probs else 0.0,
            kl_estimator=algo.kl_estimator,
            entropy=entropy,
            entropy_coef=algo.entropy_coef,
            importance_weight=weight,
            loss_scale=1.0,
        )
        if old_log_probs:  # recomputed by the trainer: how far the engine's own log-probs were from them
            engine = padded({s: r.log_probs for s, r in zip(group, group_requests)})
            stats["logprob_gap"] = (padded(old_log_probs) - engine)[mask].abs().mean().item()
        return loss, stats

    if passes is not None:
        return None, backward_in_lockstep(model, list(requests), group_loss, passes), normaliser
    gradient, stats = accumulate_group_gradients(model, list(requests), group_loss)
    return gradient, stats, normaliser


def step_advantages(
    rewards: dict[SampleId, float],
    scored_requests: dict[SampleId, Request],
    old_log_probs: dict[SampleId, object],
    ref_log_probs: dict[SampleId, object],
    *,
    algo,
    max_new_tokens: int,
    generated: dict[SampleId, Sequence[bool]] | None = None,
) -> dict[SampleId, float]:
    """Each scored sample's advantage (`algo.advantages`, estimator `algo.advantage`) from its reward shaped first
    (`shaped_rewards`). Lengths are response tokens."""
    scored, shaped, lengths = shaped_rewards(
        rewards,
        scored_requests,
        old_log_probs,
        ref_log_probs,
        algo=algo,
        max_new_tokens=max_new_tokens,
        generated=generated,
    )
    estimated = advantages(
        algo.advantage,
        shaped,
        torch.tensor([s.prompt for s in scored]),
        lengths,
        std_scope=algo.std_scope,
        clip=algo.adv_clip,
    )
    return dict(zip(scored, estimated.tolist()))


def shaped_rewards(
    rewards: dict[SampleId, float],
    scored_requests: dict[SampleId, Request],
    old_log_probs: dict[SampleId, object],
    ref_log_probs: dict[SampleId, object],
    *,
    algo,
    max_new_tokens: int,
    generated: dict[SampleId, Sequence[bool]] | None = None,
) -> tuple[list[SampleId], torch.Tensor, torch.Tensor]:
    """The scored samples in key order, their rewards shaped (fp64) and their response lengths: each reward plus
    DAPO's overlong penalty (`algo.overlong_buffer`), and with `algo.kl_in: reward` less beta x its summed KL
    estimate to the reference (where `ref_log_probs` are given) at the old log-probs, which the pipelines recompute
    for it (`LMTrainConfig.recomputes_old_log_probs`; the engine's where none were: the start-up profile's)
    (`sequence_kl`)."""
    scored = sorted(rewards)
    lengths = torch.tensor([len(scored_requests[s].tokens) for s in scored], dtype=torch.float64)
    shaped = torch.tensor([rewards[s] for s in scored], dtype=torch.float64)
    shaped = shaped + overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
    if algo.kl_in == "reward" and algo.beta > 0 and ref_log_probs:
        penalties = []
        for sample in scored:
            request = scored_requests[sample]
            policy = old_log_probs[sample] if old_log_probs else request.log_probs
            sampled = generated[sample] if generated else [True] * len(request.tokens)
            penalties.append(
                sequence_kl(
                    torch.as_tensor(np.asarray(policy)),
                    torch.as_tensor(np.asarray(ref_log_probs[sample])),
                    torch.as_tensor(list(sampled)),
                    algo.kl_estimator,
                )
            )
        shaped = shaped - algo.beta * torch.tensor(penalties, dtype=torch.float64)
    return scored, shaped, lengths


def step_gae(
    rewards: dict[SampleId, float],
    scored_requests: dict[SampleId, Request],
    values: dict[SampleId, object],
    old_log_probs: dict[SampleId, object],
    ref_log_probs: dict[SampleId, object],
    *,
    algo,
    max_new_tokens: int,
    generated: dict[SampleId, Sequence[bool]] | None = None,
) -> dict[SampleId, tuple[np.ndarray, np.ndarray]]:
    """Each scored sample's per-token GAE advantages (whitened over the step's tokens, clipped to +-algo.adv_clip,
    fp32) and returns (fp32: the critic's targets), `algo.gae_advantages_returns` on the whole step: its reward with
    the overlong penalty (`shaped_rewards`) on the response's last token, with `algo.kl_in: reward` less beta x each
    token's KL estimate at the old log-probs on that token (verl's `apply_kl_penalty`: the penalty is a token's, so a
    token's return counts the KL of the tokens after it alone), the critic's `values` of its tokens, `algo.gamma` and
    `algo.lam`. The same samples and values give the same bits on any device: the step is one padded batch in key
    order.

    `generated`: a multi-turn trajectory's mask of the tokens the model sampled. Only those are GAE's (verl's
    `response_mask` of a multi-turn rollout): an observation's tokens carry no reward, KL or TD error, and the chain
    runs across them from one model turn to the next; the outcome reward sits on the last sampled token."""
    outcome = algo.model_copy(update={"beta": 0.0})  # the KL goes on its tokens below, not summed on the last
    scored, shaped, lengths = shaped_rewards(
        rewards, scored_requests, old_log_probs, ref_log_probs, algo=outcome, max_new_tokens=max_new_tokens
    )
    width = int(lengths.max()) if scored else 0
    token_rewards = torch.zeros(len(scored), width, dtype=torch.float64)
    token_values = torch.zeros(len(scored), width, dtype=torch.float64)
    mask = torch.zeros(len(scored), width, dtype=torch.bool)
    for row, sample in enumerate(scored):
        length = int(lengths[row])
        token_values[row, :length] = torch.as_tensor(np.asarray(values[sample]), dtype=torch.float64)
        sampled = (
            torch.as_tensor(list(generated[sample]), dtype=torch.bool)
            if generated
            else torch.ones(length, dtype=torch.bool)
        )
        mask[row, :length] = sampled
        if sampled.any():
            token_rewards[row, int(sampled.nonzero()[-1])] = shaped[row]
        if algo.kl_in == "reward" and algo.beta > 0 and ref_log_probs:
            request = scored_requests[sample]
            policy = torch.as_tensor(np.asarray(old_log_probs[sample] if old_log_probs else request.log_probs))
            reference = torch.as_tensor(np.asarray(ref_log_probs[sample]))
            token_rewards[row, :length] -= (
                algo.beta * kl_estimate(policy.double(), reference.double(), algo.kl_estimator) * sampled
            )
    per_token, returns = gae_advantages_returns(token_rewards, token_values, mask, gamma=algo.gamma, lam=algo.lam)
    per_token = per_token.clamp(-algo.adv_clip, algo.adv_clip).float()
    return {
        sample: (per_token[row, : int(lengths[row])].numpy(), returns[row, : int(lengths[row])].float().numpy())
        for row, sample in enumerate(scored)
    }


def group_values(critic, prompt: list[int], responses: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's value (B, R) of every response token of a group, read where the token's log-prob is: at the
    position that predicts it (the state of the prompt and the response before it, verl's critic
    `values[:, -response_length - 1 : -1]`), and its mask; under grad when called so. One batched forward of the
    prompt repeated per response, right-padded (`pad_batch`), so a group gives the same bits in any part."""
    device = compute_device(critic)
    ids, attention_mask = pad_batch([prompt + r for r in responses])
    per_position = critic(input_ids=ids.to(device), attention_mask=attention_mask.long().to(device))
    targets, mask = pad_batch(responses)
    mask = mask.to(device)
    predicting = len(prompt) - 1 + torch.arange(targets.shape[1], device=device)
    predicting = predicting.clamp(max=per_position.shape[1] - 1)  # padding columns: any valid position, masked
    return per_position[:, predicting].masked_fill(~mask, 0.0), mask


def value_padding_pass(critic) -> torch.Tensor:
    """`padding_pass` for a sharded critic: one token's value, times 0."""
    one = torch.zeros(1, 1, dtype=torch.long, device=compute_device(critic))
    return critic(input_ids=one, attention_mask=torch.ones_like(one)).sum() * 0.0


def step_values(critic, requests: dict[SampleId, Request], passes: int | None = None) -> dict[SampleId, torch.Tensor]:
    """Each response's values (`group_values`, a group at a time: one forward, the same calls on any member of a
    sharded critic's group), without grad: the rollout's value pass. `passes`: the forwards every member of a
    sharded critic's group makes (`value_padding_pass`es after its own groups); None for a replica."""
    out: dict[SampleId, torch.Tensor] = {}
    groups = by_group(requests)
    with torch.no_grad():
        for group in groups:
            chosen = [requests[s] for s in group]
            values, mask = group_values(critic, group_prompt(chosen), [r.tokens for r in chosen])
            out |= {s: row[m] for s, row, m in zip(group, values, mask)}
        for _ in range(_padding(groups, passes)):
            value_padding_pass(critic)
    return out


def value_gradient(
    critic,
    requests: dict[SampleId, Request],
    rewards: dict[SampleId, float],
    values: dict[SampleId, object],
    old_log_probs: dict[SampleId, object],
    ref_log_probs: dict[SampleId, object],
    *,
    algo,
    cliprange_value: float,
    max_new_tokens: int,
    scored_requests: dict[SampleId, Request] | None = None,
    generated: dict[SampleId, Sequence[bool]] | None = None,
    passes: int | None = None,
) -> tuple[torch.Tensor | None, list[dict]]:
    """The critic's gradient of the groups of `requests` (a part of the step, whole groups), summed in fp64
    (`accumulate_group_gradients`), and each group's statistics: PPO's clipped value loss
    (`algo.clipped_value_loss`, summed: loss_scale 1) of its values under grad against the step's GAE returns
    (`step_gae` over every scored sample), clipped around the rollout's `values`. Aggregated as the actor's loss over
    the same tokens, it shares the actor's normaliser: the commit scales both by the step's. `generated`: as
    `policy_gradient`'s, a multi-turn trajectory's observation tokens are no value targets. `passes`: on a member of
    a sharded critic's group, the passes every member makes (`backward_in_lockstep`): the gradient stays in the
    critic's shards and None is returned in its place."""
    scored = requests if scored_requests is None else scored_requests
    gae = step_gae(
        rewards,
        scored,
        values,
        old_log_probs,
        ref_log_probs,
        algo=algo,
        max_new_tokens=max_new_tokens,
        generated=generated,
    )

    def group_loss(group: list[SampleId]):
        chosen = [requests[s] for s in group]
        predicted, mask = group_values(critic, group_prompt(chosen), [r.tokens for r in chosen])
        if generated:
            mask = mask & sampled_mask(mask, [generated[s] for s in group])
        if not mask.any():  # a member of a sharded group backpropagates it all the same (`backward_in_lockstep`)
            return None if passes is None else (predicted.sum() * 0.0, None)

        def padded(per_sample: dict) -> torch.Tensor:
            out = torch.zeros_like(predicted)
            for row, sample in enumerate(group):
                row_values = torch.as_tensor(np.asarray(per_sample[sample]), dtype=predicted.dtype)
                out[row, : len(row_values)] = row_values.to(out.device)
            return out

        return clipped_value_loss(
            predicted,
            padded(values),
            padded({s: gae[s][1] for s in group}),
            mask,
            cliprange_value=cliprange_value,
            aggregation=algo.aggregation,
            max_tokens=max_new_tokens,
            loss_scale=1.0,
        )

    if passes is not None:
        return None, backward_in_lockstep(critic, list(requests), group_loss, passes, value_padding_pass)
    return accumulate_group_gradients(critic, list(requests), group_loss)
