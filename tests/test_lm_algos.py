"""The LM algorithms a verl / TRL user expects (docs/algorithms.md): each registered advantage estimator, policy loss,
KL estimator, reward shaping and rollout correction against its upstream formula transcribed here on the same
tensors (<= 1e-6), their invariants, the config's refusals, and short runs of configs/sort.yaml that learn.

Transcribed independently of dovetail's code from verl (verl/trainer/ppo/core_algos.py, volcengine/verl 012be9d:
the outcome estimators, `compute_policy_loss_gspo`, `kl_penalty`, `apply_kl_penalty`, and
verl/utils/torch_functional.py `masked_whiten`), TRL (trl/trainer/grpo_trainer.py, vLLM importance sampling
correction) and DAPO (arXiv 2503.14476, eq. 13, the overlong reward shaping as verl's DAPO reward manager writes it).
"""

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from running import train
from safetensors.torch import load_file
from test_run_ux import metric_lines, undocumented

from dovetail.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, advantages, lm_grpo_loss, rollout_correction_weight
from dovetail.algo.lm_grpo import KL_ESTIMATORS, ROLLOUT_CORRECTIONS, kl_estimate
from dovetail.algo.reward_shaping import overlong_penalty
from dovetail.config.common import PACKAGE_ROOT, ConfigError
from dovetail.config.load import load_config
from dovetail.graph.node import SampleId
from dovetail.models.engine import Request
from dovetail.models.lm import load_lm
from dovetail.models.lm_rl import policy_gradient, step_advantages
from dovetail.pipelines.lm.config import GSPO_CLIPS, WHOLE_BATCH_ADVANTAGES, LMAlgoSection
from dovetail.pipelines.lm.dynamic_sampling import informative_samples
from dovetail.runtime.messages import Scores

torch.set_num_threads(1)
SORT_YAML = Path(__file__).parents[1] / "configs" / "sort.yaml"
NO_CLIP = 1e9

# ------------------------------------------------------------------ upstream, transcribed


def verl_masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def verl_masked_whiten(values, mask):
    """verl/utils/torch_functional.py masked_var (unbiased) and masked_whiten (shift_mean=True)."""
    mean = verl_masked_mean(values, mask)
    variance = verl_masked_mean((values - mean) ** 2, mask)
    variance = variance * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_rloo(token_level_rewards, response_mask, index):
    """compute_rloo_outcome_advantage."""
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, members in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(members) == 1 else torch.mean(torch.stack(members))
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def verl_reinforce_plus_plus(token_level_rewards, response_mask, gamma=1.0):
    """compute_reinforce_plus_plus_outcome_advantage."""
    returns = torch.zeros_like(token_level_rewards)
    running = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    return verl_masked_whiten(returns, response_mask) * response_mask


def verl_reinforce_plus_plus_baseline(token_level_rewards, response_mask, index):
    """compute_reinforce_plus_plus_baseline_outcome_advantage."""
    length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, members in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(members) == 1 else torch.mean(torch.stack(members))
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, length]) * response_mask
    return verl_masked_whiten(scores, response_mask) * response_mask


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high):
    """compute_policy_loss_gspo with agg_loss 'seq-mean-token-mean' (its only aggregation)."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    losses = torch.maximum(losses1, losses2)
    per_sequence = torch.sum(losses * response_mask, dim=-1) / torch.sum(response_mask, dim=-1)
    return torch.mean(per_sequence)


def verl_kl_penalty(logprob, ref_logprob, kind):
    """kl_penalty: 'kl' (k1), 'mse' (k2), 'low_var_kl' (k3, clamped to +-10)."""
    if kind == "kl":
        return logprob - ref_logprob
    if kind == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    kl = ref_logprob - logprob
    kl = torch.clamp(kl, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def trl_vllm_importance_weight(old_per_token_logps, sampling_per_token_logps, mode, cap):
    """GRPOTrainer's vLLM importance sampling correction, token_truncate and token_mask modes."""
    ratio = torch.exp(old_per_token_logps - sampling_per_token_logps)
    if mode == "token_truncate":
        return torch.clamp(ratio, max=cap)
    return ratio.masked_fill(ratio > cap, value=0.0)


def dapo_overlong_reward(valid_response_length, max_resp_len, overlong_buffer_len, penalty_factor):
    """DAPO's soft overlong punishment as verl's DAPO reward manager adds it to the score."""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * penalty_factor, 0)


# ------------------------------------------------------------------ a batch of outcome rewards


def outcome_batch(seed: int, groups: int = 4, group_size: int = 5, width: int = 7):
    """Rewards of `groups` x `group_size` responses of ragged lengths, one group with all rewards equal, as verl sees
    them: the reward on each response's last token of a right-padded (B, T) mask."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.rand(groups * group_size, generator=generator, dtype=torch.float64).round(decimals=1)
    rewards[:group_size] = 0.5
    lengths = torch.randint(1, width + 1, (groups * group_size,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    token_rewards = torch.zeros(groups * group_size, width, dtype=torch.float64)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards
    group_ids = torch.arange(groups).repeat_interleave(group_size)
    return rewards, group_ids, lengths, token_rewards, mask


def per_sequence(token_values, mask):
    """verl's (B, T) advantages, the same on every response token: one per response."""
    first = token_values[:, 0]
    assert torch.allclose(token_values, first[:, None] * mask, atol=1e-12)
    return first


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_advantage_estimators_equal_verls(name, seed):
    rewards, group_ids, lengths, token_rewards, mask = outcome_batch(seed)
    index = group_ids.tolist()
    upstream = {
        "rloo": lambda: verl_rloo(token_rewards.clone(), mask, index),
        "reinforce_plus_plus": lambda: verl_reinforce_plus_plus(token_rewards.clone(), mask),
        "reinforce_plus_plus_baseline": lambda: verl_reinforce_plus_plus_baseline(token_rewards.clone(), mask, index),
    }[name]()
    ours = advantages(name, rewards, group_ids, lengths.double(), clip=NO_CLIP)
    torch.testing.assert_close(ours.double(), per_sequence(upstream, mask), atol=1e-6, rtol=0)


def test_rloo_is_reward_minus_the_mean_of_the_others_and_sums_to_zero_per_group():
    rewards, group_ids, lengths, _, _ = outcome_batch(3)
    ours = advantages("rloo", rewards, group_ids, lengths.double(), clip=NO_CLIP).double()
    for i in range(len(rewards)):
        others = (group_ids == group_ids[i]) & (torch.arange(len(rewards)) != i)
        assert ours[i].item() == pytest.approx((rewards[i] - rewards[others].mean()).item(), abs=1e-6)
    for group in group_ids.unique():
        assert ours[group_ids == group].sum().item() == pytest.approx(0.0, abs=1e-6)
    assert (ours[group_ids == 0] == 0).all(), "a group of equal rewards gets exactly 0"


def test_whitened_estimators_have_token_weighted_mean_zero_and_unit_variance():
    rewards, group_ids, lengths, _, _ = outcome_batch(4)
    weights = lengths.double()
    for name in [n for n in WHOLE_BATCH_ADVANTAGES if not ADVANTAGE_ESTIMATORS[n].needs_values]:  # gae: per token
        ours = advantages(name, rewards, group_ids, weights, clip=NO_CLIP).double()
        mean = (ours * weights).sum() / weights.sum()
        variance = (((ours - mean) ** 2) * weights).sum() / (weights.sum() - 1)
        assert mean.item() == pytest.approx(0.0, abs=1e-6) and variance.item() == pytest.approx(1.0, rel=1e-6)


def test_the_registries_are_the_configs_choices():
    """One spelling each: the config's Literal choices are the registries' names (the config may not import torch)."""
    fields = LMAlgoSection.model_fields
    assert set(fields["advantage"].annotation.__args__) == set(ADVANTAGE_ESTIMATORS)
    assert set(fields["loss"].annotation.__args__) == set(POLICY_LOSSES)
    assert set(fields["kl_estimator"].annotation.__args__) == set(KL_ESTIMATORS)
    assert set(fields["rollout_correction"].annotation.__args__[0].__args__) == set(ROLLOUT_CORRECTIONS)
    assert {n for n, e in ADVANTAGE_ESTIMATORS.items() if e.whole_batch} == set(WHOLE_BATCH_ADVANTAGES)


# ------------------------------------------------------------------ GSPO


def off_policy_batch(seed: int, mask):
    generator = torch.Generator().manual_seed(seed)
    log_probs = (torch.randn(mask.shape, generator=generator, dtype=torch.float64) - 1.0).requires_grad_()
    old = log_probs.detach() + 0.02 * torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    adv = torch.randn(mask.shape[0], generator=generator, dtype=torch.float64)
    return log_probs, old, adv


RAGGED = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(("clip_low", "clip_high"), [GSPO_CLIPS, (0.2, 0.28), (0.004, 0.003)])
def test_gspo_loss_and_gradient_equal_verls(seed, clip_low, clip_high):
    """With `sequence` aggregation (verl's seq-mean-token-mean); the small clips silence some sequences, not all."""
    log_probs, old, adv = off_policy_batch(seed, RAGGED)
    ours, _ = lm_grpo_loss(
        log_probs, old, adv, RAGGED, clip_low=clip_low, clip_high=clip_high, policy_loss="gspo", aggregation="sequence"
    )
    (ours_grad,) = torch.autograd.grad(ours, log_probs)
    upstream = verl_gspo(old, log_probs, adv[:, None], RAGGED, clip_low, clip_high)
    (upstream_grad,) = torch.autograd.grad(upstream, log_probs)
    assert ours.item() == pytest.approx(upstream.item(), abs=1e-6)
    torch.testing.assert_close(ours_grad * RAGGED, upstream_grad * RAGGED, atol=1e-6, rtol=0)


def test_gspo_clips_a_whole_sequence_at_once():
    """A sequence's ratio is one number: either all its tokens are clipped or none."""
    log_probs, old, adv = off_policy_batch(7, RAGGED)
    adv = adv.abs()
    loss, _ = lm_grpo_loss(log_probs, old, adv, RAGGED, clip_low=1e-4, clip_high=1e-4, policy_loss="gspo")
    (grad,) = torch.autograd.grad(loss, log_probs)
    for row in range(len(RAGGED)):
        live = grad[row][RAGGED[row].bool()] != 0
        assert live.all() or not live.any()


@pytest.mark.parametrize("aggregation", ["token", "sequence", "drgrpo"])
def test_gspo_equals_ppo_clip_when_every_sequence_has_one_token(aggregation):
    mask = torch.ones(6, 1, dtype=torch.float64)
    log_probs, old, adv = off_policy_batch(5, mask)
    results = []
    for loss_name in POLICY_LOSSES:
        loss, _ = lm_grpo_loss(log_probs, old, adv, mask, policy_loss=loss_name, aggregation=aggregation, max_tokens=4)
        results.append((loss, *torch.autograd.grad(loss, log_probs)))
    (ppo_loss, ppo_grad), (gspo_loss, gspo_grad) = results
    assert gspo_loss.item() == pytest.approx(ppo_loss.item(), abs=1e-12)
    torch.testing.assert_close(gspo_grad, ppo_grad, atol=1e-12, rtol=0)


def test_on_policy_gspo_has_grpos_gradient():
    """One optimizer step a batch: the old log-probs are the current ones, every ratio is 1 and never clipped, and
    the sequence ratio's gradient (its tokens' mean) weighs each token as the token ratio does."""
    log_probs, _, adv = off_policy_batch(9, RAGGED)
    grads = []
    for loss_name in POLICY_LOSSES:
        loss, _ = lm_grpo_loss(log_probs, log_probs.detach(), adv, RAGGED, policy_loss=loss_name)
        grads.append(torch.autograd.grad(loss, log_probs)[0])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-12, rtol=0)


# ------------------------------------------------------------------ KL


@pytest.mark.parametrize(("ours", "verls"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_estimators_equal_verls_kl_penalty(ours, verls):
    generator = torch.Generator().manual_seed(11)
    log_probs = torch.randn(5, 6, generator=generator, dtype=torch.float64) - 2
    ref = log_probs + torch.randn(5, 6, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(log_probs, ref, ours), verl_kl_penalty(log_probs, ref, verls))


def test_k2_in_the_loss_has_the_gradient_of_half_the_squared_log_ratio():
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 7.0]], dtype=torch.float64)  # the last token is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = lm_grpo_loss(
        log_probs, log_probs.detach(), torch.zeros(1), mask, ref_log_probs=ref, beta=0.1, kl_estimator="k2"
    )
    assert stats["kl_ref"] == pytest.approx((0.5 * 0.25 + 0.5 * 1.0) / 2)
    (grad,) = torch.autograd.grad(loss, log_probs)
    torch.testing.assert_close(grad, 0.1 * torch.tensor([[0.5, -1.0, 0.0]], dtype=torch.float64) / 2)


# ------------------------------------------------------------------ reward shaping


def test_overlong_penalty_equals_dapos():
    lengths = torch.arange(0, 33)
    ours = overlong_penalty(lengths, max_new_tokens=32, buffer=8, factor=1.5)
    expected = [dapo_overlong_reward(int(n), 32, 8, 1.5) for n in lengths]
    torch.testing.assert_close(ours, torch.tensor(expected, dtype=torch.float64))
    assert ours[24].item() == 0 and ours[32].item() == -1.5
    assert (overlong_penalty(lengths, max_new_tokens=32, buffer=0, factor=1.5) == 0).all()


def algo_of(*overrides: str) -> LMAlgoSection:
    return load_config(None, ["kind=lm", *overrides]).algo


def scored_step(seed: int, groups: int = 3, group_size: int = 4):
    """A step's rewards and requests with engine log-probs, and reference log-probs for each response."""
    generator = torch.Generator().manual_seed(seed)
    requests, rewards, ref = {}, {}, {}
    for p in range(groups):
        for i in range(group_size):
            sample = SampleId(0, p, i)
            length = int(torch.randint(1, 9, (1,), generator=generator))
            log_probs = (-torch.rand(length, generator=generator, dtype=torch.float64) * 3).tolist()
            requests[sample] = Request(sample, [1, 2], list(range(3, 3 + length)), log_probs, True)
            rewards[sample] = float(torch.randint(0, 2, (1,), generator=generator))
            ref[sample] = np.array(log_probs) + 0.3 * torch.randn(length, generator=generator).numpy()
    return requests, rewards, ref


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_reward_is_verls_apply_kl_penalty_summed_over_the_response(estimator):
    """verl: token_level_rewards = token_level_scores - beta * kl_penalty(old, ref) per token, and an outcome
    estimator reads their sum, at the old log-probs the trainer recomputed."""
    verls = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}[estimator]
    requests, rewards, ref = scored_step(1)
    algo = algo_of("algo.kl_in=reward", "algo.beta=0.3", f"algo.kl_estimator={estimator}", "algo.advantage=rloo")
    recomputed = {s: np.array(r.log_probs) - 0.01 * np.arange(len(r.tokens)) for s, r in requests.items()}
    ours = step_advantages(rewards, requests, recomputed, ref, algo=algo, max_new_tokens=8)
    scored = sorted(rewards)
    penalised = []
    for s in scored:
        old, reference = torch.as_tensor(recomputed[s]), torch.as_tensor(ref[s])
        scores = torch.zeros(len(old), dtype=torch.float64)
        scores[-1] = rewards[s]
        penalised.append((scores - 0.3 * verl_kl_penalty(old, reference, verls)).sum())
    token_rewards = torch.stack(penalised)[:, None]
    expected = verl_rloo(token_rewards, torch.ones_like(token_rewards), [s.prompt for s in scored])[:, 0]
    torch.testing.assert_close(
        torch.tensor([ours[s] for s in scored], dtype=torch.float64), expected, atol=1e-6, rtol=0
    )


def test_overlong_shaping_reaches_the_advantages():
    requests, rewards, ref = scored_step(2)
    plain = step_advantages(rewards, requests, {}, ref, algo=algo_of("algo.advantage=rloo"), max_new_tokens=8)
    shaped_algo = algo_of("algo.advantage=rloo", "algo.overlong_buffer=4", "algo.overlong_penalty=0.5")
    shaped = step_advantages(rewards, requests, {}, ref, algo=shaped_algo, max_new_tokens=8)
    scored = sorted(rewards)
    penalty = overlong_penalty(torch.tensor([len(requests[s].tokens) for s in scored]), 8, 4, 0.5)
    moved = verl_rloo(penalty[:, None].clone(), torch.ones(len(scored), 1), [s.prompt for s in scored])[:, 0]
    torch.testing.assert_close(
        torch.tensor([shaped[s] - plain[s] for s in scored], dtype=torch.float64), moved, atol=1e-6, rtol=0
    )


# ------------------------------------------------------------------ rollout correction (TIS / MIS)


@pytest.mark.parametrize(("ours", "trls"), [("tis", "token_truncate"), ("mis", "token_mask")])
def test_rollout_correction_equals_trls_vllm_importance_sampling(ours, trls):
    generator = torch.Generator().manual_seed(3)
    trainer = torch.randn(4, 6, generator=generator, dtype=torch.float64) - 2
    engine = trainer + torch.randn(4, 6, generator=generator, dtype=torch.float64)
    expected = trl_vllm_importance_weight(trainer, engine, trls, 2.0)
    torch.testing.assert_close(rollout_correction_weight(trainer, engine, ours, 2.0), expected)
    assert (expected == 2.0).any() or (expected == 0.0).any(), "the cap bites somewhere"


def test_rollout_correction_weight_is_exactly_one_where_the_engine_is_the_trainer():
    log_probs = torch.randn(3, 5) * 4
    for mode in ROLLOUT_CORRECTIONS:
        assert (rollout_correction_weight(log_probs, log_probs.clone(), mode, 1.0) == 1.0).all()


def test_an_engine_that_matches_the_trainer_gets_no_correction_and_vllm_gets_tis():
    """And the KL in the reward has the trainer recompute the old log-probs, as vLLM's runs do."""
    assert not load_config(None, ["kind=lm", "algo.kl_in=reward"]).recomputes_old_log_probs  # beta 0: no KL
    assert load_config(None, ["kind=lm", "algo.kl_in=reward", "algo.beta=0.1"]).recomputes_old_log_probs
    assert load_config(None, ["kind=lm", "sampling.engine=vllm"]).recomputes_old_log_probs
    assert algo_of().rollout_correction == "none"
    assert algo_of("sampling.engine=vllm").rollout_correction == "tis"
    assert algo_of("sampling.engine=vllm", "algo.rollout_correction=mis").rollout_correction == "mis"


def test_tis_weights_each_tokens_surrogate_in_the_policy_gradient():
    """Through `policy_gradient` on the sort model, old log-probs given (as vLLM's pipelines recompute them): with
    the engine's log-probs equal to those the TIS gradient is the uncorrected one to the bit; with the engine's a
    token's log-prob off, the gradient is that of the loss with the token's surrogate weighted by min(ratio, cap)."""
    model, tokenizer, _ = load_lm(PACKAGE_ROOT / "assets" / "sort-lm")
    prompt = tokenizer.prompt_ids("sort 3 1 2:")
    responses = [tokenizer.encode(text) for text in ("1 2 3", "3 2 1", "1 3", "2")]
    samples = [SampleId(0, 0, i) for i in range(len(responses))]
    rewards = {s: float(i % 2) for i, s in enumerate(samples)}
    with torch.no_grad():
        from dovetail.models.lm_rl import group_response_log_probs

        log_probs, mask = group_response_log_probs(model, prompt, responses, 1.0)
    old = {s: row[m].numpy() for s, row, m in zip(samples, log_probs, mask)}

    def gradient(engine_shift: float, correction: str):
        requests = {
            s: Request(s, prompt, r, (old[s] + engine_shift * (np.arange(len(r)) == 0)).tolist(), True)
            for s, r in zip(samples, responses)
        }
        algo = algo_of(f"algo.rollout_correction={correction}", "algo.rollout_correction_cap=1.5")
        result, _, normaliser = policy_gradient(
            model, requests, rewards, old, {}, algo=algo, temperature=1.0, max_new_tokens=8, stale=False
        )
        return result, normaliser

    none, _ = gradient(0.0, "none")
    matched, _ = gradient(0.0, "tis")
    assert torch.equal(none, matched)
    # every first token's engine log-prob 1 lower: ratio e > 1.5, so its surrogate weighs 1.5, the others 1
    shifted, normaliser = gradient(-1.0, "tis")
    model.zero_grad(set_to_none=True)
    log_probs, mask = group_response_log_probs(model, prompt, responses, 1.0)
    adv = advantages("grpo", torch.tensor([rewards[s] for s in samples]), torch.zeros(4), torch.ones(4))
    weight = torch.ones_like(log_probs)
    weight[:, 0] = 1.5
    loss, _ = lm_grpo_loss(
        log_probs, log_probs.detach(), adv, mask, importance_weight=weight, loss_scale=1.0, max_tokens=8
    )
    loss.backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).double()
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(shifted, expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(shifted, none)


# ------------------------------------------------------------------ dynamic sampling and the config


def test_informative_samples_drop_the_groups_of_equal_rewards():
    samples = [SampleId(0, p, i) for p in range(3) for i in range(2)]
    scores = Scores(samples, {"total": np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])}, np.ones(6, dtype=int))
    assert informative_samples(scores) == samples[2:4]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["policy=streamrl", "algo.advantage=reinforce_plus_plus"],
            "algo.advantage=reinforce_plus_plus whitens over the whole step: set algo.micro_batches=1 or policy: "
            "reference (policy is streamrl)",
        ),
        (["algo.advantage=rloo", "algo.std_scope=none"], "algo.std_scope=none scales grpo's advantages"),
        (["algo.overlong_buffer=4000"], "algo.overlong_buffer=4000 exceeds max_new_tokens=31: lower it"),
        (["algo.loss=ppo"], "algo.loss"),
        (["algo.num_iterations=0"], "algo.num_iterations"),
        (["algo.dynamic_sampling=true", "algo.dynamic_sampling_max_draws=0"], "algo.dynamic_sampling_max_draws"),
        (
            ["algo.num_iterations=2", "train.sharding=fsdp"],
            "algo.num_iterations=2: a sharded trainer takes one update a batch yet; set algo.num_iterations=1 or "
            "train.sharding: replicate",
        ),
    ],
)
def test_an_algorithm_the_run_cannot_honour_is_one_line_naming_the_fix(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["kind=lm", *overrides])
    assert message in str(error.value) and "\n" not in str(error.value).strip()


@pytest.mark.parametrize("policy", ["reference", "verl-sync", "jigsaw", "jigsaw-greedy", "streamrl", "areal"])
def test_every_policy_takes_dynamic_sampling_in_micro_batches_but_not_an_env_runs_episodes(policy):
    """A run's scenario draws `dynamic_sampling_max_draws` batches a step in the run's micro-batches under every
    policy; an env run's episodes are not redrawn, which the config says in one line naming the fix."""
    dynamic = [f"policy={policy}", "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_draws=3"]
    (pipeline,) = load_config(None, ["kind=lm", *dynamic, "algo.micro_batches=2"]).scenario(1).pipelines
    assert (pipeline.draws, pipeline.micro_batches, pipeline.dynamic_sampling) == (3, 2, True)
    with pytest.raises(ConfigError) as error:
        load_config(SORT_YAML.with_name("calc.yaml"), dynamic)
    message = str(error.value).strip()
    assert "algo.dynamic_sampling: an env run's episodes are not redrawn yet; set it to false" in message
    assert "\n" not in message


def test_gspo_takes_its_own_clips_unless_the_config_names_them():
    assert (algo_of("algo.loss=gspo").clip_low, algo_of("algo.loss=gspo").clip_high) == GSPO_CLIPS
    assert algo_of("algo.loss=gspo", "algo.clip_low=0.01").clip_low == 0.01
    assert algo_of("policy=verl-sync", "algo.advantage=rloo").advantage == "rloo"
    assert algo_of("policy=verl-sync", "algo.micro_batches=1", "algo.advantage=reinforce_plus_plus").micro_batches == 1


# ------------------------------------------------------------------ short runs that learn

LEARN = [
    "policy=reference",
    "cluster.devices=1",
    "algo.prompts_per_step=8",
    "algo.group_size=8",
    "train.lr=1e-3",
    "eval.every=10",
    "eval.prompts=32",
    "checkpoint.every=100",
    "reward={toy_rewards:short_completions: 1.0}",
]
TOY = "eval/reward/toy_rewards:short_completions"


def learning_curve(tmp_path, *overrides: str) -> tuple[float, list[dict]]:
    """The base model's held-out toy reward and the run's metric lines."""
    sys.path.insert(0, str(Path(__file__).parent))  # toy_rewards, as the Ray tests import it
    train(load_config(SORT_YAML, [*LEARN, *overrides]), tmp_path, steps=10)
    base = json.loads((tmp_path / "summary.json").read_text())["base_eval"][TOY.removeprefix("eval/")]
    return base, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rloo_gspo_ppo_and_dynamic_sampling_learn_like_grpo(tmp_path):
    """configs/sort.yaml in the reference loop, 10 steps on a reward the tiny model learns (short completions), seed
    0: the held-out reward rises by 0.1 for GRPO and each other algorithm (two updates a batch among them,
    algo.num_iterations; PPO: GAE with a critic, tests/test_lm_ppo.py), and each ends within 0.1 of GRPO's.
    Dynamic sampling trains only groups whose rewards differ (`frac_reward_zero_std` 0 where it kept B groups) and
    says how many batches it drew."""
    curves = {}
    for name, overrides in {
        "grpo": [],
        "rloo": ["algo.advantage=rloo"],
        "gspo": ["algo.loss=gspo"],
        "ppo": ["algo.advantage=gae", "critic.lr=1e-3", "algo.micro_batches=1"],
        "dynamic": ["algo.dynamic_sampling=true", "algo.dynamic_sampling_max_draws=3"],
        "two_updates": ["algo.num_iterations=2"],
    }.items():
        curves[name] = learning_curve(tmp_path / name, *overrides)
    final = {}
    for name, (base, curve) in curves.items():
        final[name] = curve[-1][TOY]
        assert final[name] >= base + 0.1, (name, base, final[name])
    assert all(abs(score - final["grpo"]) <= 0.1 for score in final.values()), final
    for line in curves["dynamic"][1]:
        assert 1 <= line["dynamic_sampling/draws"] <= 3
        if line["dynamic_sampling/groups"] == 1.0:
            assert line["frac_reward_zero_std"] == 0.0
    assert math.isfinite(sum(line["loss"] for line in curves["rloo"][1]))
    # two updates a batch: the first on policy (ratio 1, nothing clipped), the second from the first's old log-probs
    two, one = curves["two_updates"][1], curves["grpo"][1]
    assert all(line["clip_frac"] == 0.0 and line["ratio_mean"] == 1.0 for line in two)
    assert all(line["update_2/clip_frac"] > 0 and line["update_2/ratio_mean"] != 1.0 for line in two)
    assert [line["reward/total"] for line in two] != [line["reward/total"] for line in one]  # another run


RAY_SMALL = [
    "kind=lm",
    "task=sort",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "algo.micro_batches=1",
    "eval.prompts=8",
    "eval.every=100",
    "runtime.profile_samples=4",
    "train.lr=1e-3",
    # the whole-batch estimator, the sequence ratio, KL in the reward and the overlong penalty at once
    "algo.advantage=reinforce_plus_plus_baseline",
    "algo.loss=gspo",
    "algo.kl_in=reward",
    "algo.beta=0.05",
    "algo.kl_estimator=k2",
    "algo.overlong_buffer=8",
]


DYNAMIC = [*RAY_SMALL[:8], "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_draws=3", "cluster.devices=2"]
"""A 3-step sort run whose seed draws more than once in a step and drops groups: every policy's dynamic sampling."""
KEPT = ("dynamic_sampling/draws", "dynamic_sampling/groups", "dynamic_sampling/dropped", "reward/total")


@pytest.fixture(scope="module")
def reference_dynamic(tmp_path_factory) -> Path:
    """The reference loop's run of `DYNAMIC`."""
    out = tmp_path_factory.mktemp("reference-dynamic")
    train(load_config(None, [*DYNAMIC, "policy=reference"]), out, steps=3)
    return out


def kept_and_trained_once(out: Path, lines: list[dict]) -> None:
    """The ledger of a dynamic-sampling run: every sample drawn generated and scored once, B prompts of G responses
    a draw, and the groups kept (B where the draws found B that differ; none differing: the first draw's B) trained
    once each; a step that kept B groups that differ trained no group of equal rewards."""
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["problems"] == []
    for step, m in enumerate(lines):
        generated = [g for g in ledger["generated"] if g["step"] == step]
        trained = [t for t in ledger["trained"] if t["step"] == step]
        assert len(generated) == m["dynamic_sampling/draws"] * 4 * 4  # B prompts of G responses a draw
        kept = round(m["dynamic_sampling/groups"] * 4) or 4  # none differing: the first draw's B groups
        assert len(trained) == kept * 4 and all(t["times"] == 1 for t in trained)
        if m["dynamic_sampling/groups"] == 1.0:
            assert m["frac_reward_zero_std"] == 0.0


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.parametrize(
    "overrides",
    [
        ["policy=verl-sync"],
        # the tail migrates in each draw (length bands), and the groups kept train in two micro-batches
        ["policy=jigsaw", "algo.micro_batches=2", "runtime.length_bands=[8,16]"],
    ],
    ids=["verl-sync", "jigsaw"],
)
def test_dynamic_sampling_on_an_on_policy_ray_run_draws_and_trains_what_the_reference_loop_does(
    overrides, local_ray, reference_dynamic, tmp_path
):
    """algo.dynamic_sampling under verl-sync and jigsaw on 2 devices: each further draw is rolled out after the one
    before is scored, only where the step still lacks B groups that differ, and the step trains the groups the
    reference loop keeps (the first B that differ by prompt position), cut into the run's micro-batches: the same
    draws, dropped groups and rewards each step, the same parameters to the bit, and a ledger of every sample drawn
    generated and scored once and the kept ones trained once."""
    train(load_config(None, [*DYNAMIC, *overrides]), tmp_path, steps=3)
    ends = [
        load_file(str(out / "checkpoints" / "step_000003" / "model.safetensors"))
        for out in (reference_dynamic, tmp_path)
    ]
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    lines, expected = metric_lines(tmp_path), metric_lines(reference_dynamic)
    assert [[m[k] for k in KEPT] for m in lines] == [[m[k] for k in KEPT] for m in expected]
    assert max(m["dynamic_sampling/draws"] for m in expected) > 1  # the seed's run drew more: the test bites
    assert sum(m["dynamic_sampling/dropped"] for m in expected) > 0
    assert undocumented({k for m in [*lines, *expected] for k in m}) == []
    kept_and_trained_once(tmp_path, lines)
    if "runtime.length_bands=[8,16]" in overrides:  # the tail of a further draw migrated too
        migrated = json.loads((tmp_path / "ledger.json").read_text())["migrated"]
        drew = [step for step, m in enumerate(lines) if m["dynamic_sampling/draws"] > 1]
        assert any(sum(1 for x in migrated if x["step"] == step and x["responses"]) > 1 for step in drew)


@pytest.mark.slow
@pytest.mark.exactness
def test_dynamic_sampling_of_one_draw_filters_each_step_as_the_reference_loop_does(local_ray, tmp_path):
    """algo.dynamic_sampling_max_draws=1 drops the groups of equal rewards and draws nothing more: under verl-sync in
    two micro-batches, a step that keeps fewer than B groups (one, on this seed: a micro-batch left empty) trains
    them to the reference loop's bits, each once, and none it dropped."""
    one = [*DYNAMIC, "algo.dynamic_sampling_max_draws=1", "algo.micro_batches=2"]
    for policy in ("reference", "verl-sync"):
        train(load_config(None, [*one, f"policy={policy}"]), tmp_path / policy, steps=3)
    ends = [
        load_file(str(tmp_path / p / "checkpoints" / "step_000003" / "model.safetensors"))
        for p in ("reference", "verl-sync")
    ]
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    lines = metric_lines(tmp_path / "verl-sync")
    assert [[m[k] for k in KEPT] for m in lines] == [[m[k] for k in KEPT] for m in metric_lines(tmp_path / "reference")]
    assert min(m["dynamic_sampling/groups"] for m in lines) == 0.25 and all(
        m["dynamic_sampling/draws"] == 1 for m in lines
    )
    kept_and_trained_once(tmp_path / "verl-sync", lines)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "bound", "micro_batches"), [("streamrl", 1, 2), ("areal", 4, 1)], ids=["streamrl", "areal"]
)
def test_dynamic_sampling_on_an_asynchronous_run_keeps_its_staleness_bound_and_fills_every_batch(
    policy, bound, micro_batches, local_ray, reference_dynamic, tmp_path
):
    """algo.dynamic_sampling under streamrl and areal: every draw of a step rolls out on the weights the step opened
    on, at most `bound` versions behind, and a step that drew more than once did so on stale weights; the first step,
    rolled out on the base weights, draws, drops and keeps what the reference loop does; every step trains B groups
    that differ (streamrl's in two micro-batches), each kept group once, and nothing it dropped."""
    config = load_config(None, [*DYNAMIC, f"policy={policy}", f"algo.micro_batches={micro_batches}"])
    summary = train(config, tmp_path, steps=3)
    lines = metric_lines(tmp_path)
    assert [lines[0][k] for k in KEPT] == [metric_lines(reference_dynamic)[0][k] for k in KEPT]
    assert summary["max_staleness"] <= bound and all(0 <= m["staleness"] <= bound for m in lines)
    generated = json.loads((tmp_path / "ledger.json").read_text())["generated"]
    assert all(0 <= g["step"] - g["version"] <= bound for g in generated)
    assert all(len({g["version"] for g in generated if g["step"] == step}) == 1 for step in range(3))
    # the case the bound is for: a step that drew more than once, rolled out on weights older than it trains
    assert any(m["dynamic_sampling/draws"] > 1 and m["staleness"] >= 1 for m in lines)
    assert all(m["dynamic_sampling/groups"] == 1.0 for m in lines)  # this seed's draws fill every batch
    kept_and_trained_once(tmp_path, lines)


@pytest.mark.slow
@pytest.mark.exactness
def test_two_updates_a_batch_on_verl_sync_end_at_the_reference_loops_bits(local_ray, tmp_path):
    """algo.num_iterations=2 under verl-sync on 2 devices: each device trains its share of the step's groups again on
    the first update's weights, with the first update's log-probs as the old ones, and the devices add their parts
    as at the first commit: the run ends at the reference loop's parameters to the bit, with the same second-update
    figures, and not at the one-update run's."""
    small = [*RAY_SMALL[:8], "algo.num_iterations=2"]
    for policy in ("reference", "verl-sync"):
        train(load_config(None, [*small, f"policy={policy}"]), tmp_path / policy, steps=2)
    train(load_config(None, [*RAY_SMALL[:8], "policy=reference"]), tmp_path / "one", steps=2)
    ends = {
        p: load_file(str(tmp_path / p / "checkpoints" / "step_000002" / "model.safetensors"))
        for p in ("reference", "verl-sync", "one")
    }
    assert all(torch.equal(ends["reference"][k], ends["verl-sync"][k]) for k in ends["reference"])
    assert max((ends["reference"][k] - ends["one"][k]).abs().max().item() for k in ends["one"]) > 1e-4
    lines = {p: [json.loads(x) for x in (tmp_path / p / "metrics.jsonl").read_text().splitlines()] for p in ends}
    for key in ("update_2/clip_frac", "update_2/ratio_mean", "update_2/grad_norm"):
        assert [m[key] for m in lines["verl-sync"]] == pytest.approx([m[key] for m in lines["reference"]], rel=1e-5)
    assert any(m["update_2/clip_frac"] > 0 for m in lines["verl-sync"])
    assert undocumented({k for logged in lines.values() for m in logged for k in m}) == []


@pytest.mark.slow
@pytest.mark.exactness
def test_verl_sync_on_ray_trains_the_new_algorithms_to_the_reference_parameters(local_ray, tmp_path):
    """The algorithms reach a Ray policy as they reach the reference loop (both go through `models.lm_rl`): verl-sync
    on 2 devices, each training a share of the step's groups, ends at the reference loop's parameters to the bit, the
    whole-batch estimator reading every response of the step from either device."""
    for policy in ("reference", "verl-sync"):
        train(load_config(None, [*RAY_SMALL, f"policy={policy}"]), tmp_path / policy, steps=2)
    ends = [
        load_file(str(tmp_path / p / "checkpoints" / "step_000002" / "model.safetensors"))
        for p in ("reference", "verl-sync")
    ]
    start = load_file(str(load_config(None, RAY_SMALL).model.checkpoint / "model.safetensors"))
    assert max((ends[0][k] - start[k]).abs().max().item() for k in start) > 1e-4, "training moved the weights"
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
