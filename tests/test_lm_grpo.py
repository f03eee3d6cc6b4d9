"""The LM GRPO loss against a loop-by-loop recomputation in plain floats and hand-computed values."""

import math

import numpy as np
import pytest
import torch

from dovetail.algo import decoupled_old_log_prob, lm_grpo_loss

torch.set_num_threads(1)

RAGGED_MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 0],  # right padding
        [1, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1],  # left padding
        [1, 1, 1, 1, 1, 1],
        [0, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
    ],
    dtype=torch.float64,
)
MAX_TOKENS = 8
SCALE_OF_WHOLE_BATCH = {
    "token": lambda mask: float(mask.sum()),
    "sequence": lambda mask: float(mask.shape[0]),
    "drgrpo": lambda mask: float(mask.shape[0] * MAX_TOKENS),
}


def reference_loss(
    log_probs,
    old_log_probs,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.28,
    aggregation="token",
    max_tokens=None,
    ref_log_probs=None,
    beta=0.0,
    kl_estimator="k3",
    entropy=None,
    entropy_coef=0.0,
    importance_weight=None,
):
    """The loss written out token by token: nested lists of floats, no tensor arithmetic."""
    log_probs, old_log_probs, mask = log_probs.tolist(), old_log_probs.tolist(), mask.tolist()
    ref_log_probs = ref_log_probs.tolist() if ref_log_probs is not None else None
    entropy = entropy.tolist() if entropy is not None else None
    importance_weight = importance_weight.tolist() if importance_weight is not None else None
    terms_per_sequence = []
    for b, advantage in enumerate(advantages.tolist()):
        terms = []
        for t in range(len(mask[b])):
            if mask[b][t] == 0:
                continue
            ratio = math.exp(log_probs[b][t] - old_log_probs[b][t])
            clipped_ratio = min(max(ratio, 1 - clip_low), 1 + clip_high)
            term = max(-advantage * ratio, -advantage * clipped_ratio)
            if importance_weight is not None:
                term *= importance_weight[b][t]
            if ref_log_probs is not None:
                d = ref_log_probs[b][t] - log_probs[b][t]
                term += beta * (-d if kl_estimator == "k1" else math.exp(d) - d - 1)
            if entropy is not None:
                term -= entropy_coef * entropy[b][t]
            terms.append(term)
        terms_per_sequence.append(terms)
    if aggregation == "token":
        return sum(sum(terms) for terms in terms_per_sequence) / sum(len(terms) for terms in terms_per_sequence)
    if aggregation == "sequence":
        return sum(sum(terms) / len(terms) for terms in terms_per_sequence) / len(terms_per_sequence)
    return sum(sum(terms) for terms in terms_per_sequence) / (len(terms_per_sequence) * max_tokens)


def reference_stats(log_probs, old_log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.28):
    """clip_frac, approx_kl and the ratio range over response tokens, one token at a time."""
    ratios, silenced, squared_log_ratios = [], 0, []
    for b, advantage in enumerate(advantages.tolist()):
        for t in range(mask.shape[1]):
            if mask[b, t] == 0:
                continue
            log_ratio = log_probs[b, t].item() - old_log_probs[b, t].item()
            ratio = math.exp(log_ratio)
            ratios.append(ratio)
            squared_log_ratios.append(log_ratio**2)
            silenced += (advantage > 0 and ratio > 1 + clip_high) or (advantage < 0 and ratio < 1 - clip_low)
    return {
        "clip_frac": silenced / len(ratios),
        "approx_kl": 0.5 * sum(squared_log_ratios) / len(ratios),
        "ratio_mean": sum(ratios) / len(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def random_batch(seed, mask=RAGGED_MASK):
    """Log-probs whose ratios straddle both clip bounds, with garbage in the padding."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=generator, dtype=torch.float64) * 3
    log_probs = old + torch.randn(mask.shape, generator=generator, dtype=torch.float64) * 0.3
    log_probs = torch.where(mask.bool(), log_probs, torch.tensor(1e4, dtype=torch.float64))
    old = torch.where(mask.bool(), old, torch.tensor(-math.inf, dtype=torch.float64))
    advantages = torch.randn(mask.shape[0], generator=generator, dtype=torch.float64)
    ref = old + torch.randn(mask.shape, generator=generator, dtype=torch.float64) * 0.5
    entropy = torch.rand(mask.shape, generator=generator, dtype=torch.float64) * 2
    return log_probs, old, advantages, ref, entropy


def test_aggregations_against_hand_values():
    """On-policy, the per-token surrogate is -A: lengths 1 and 3 with A = 1 and -2 give -1 and 2, 2, 2."""
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    zero, advantages = torch.zeros(2, 3), torch.tensor([1.0, -2.0])
    expected = {"token": (-1 + 6) / 4, "sequence": (-1 + 2) / 2, "drgrpo": (-1 + 6) / (2 * 4)}
    for aggregation, value in expected.items():
        loss, _ = lm_grpo_loss(zero, zero, advantages, mask, aggregation=aggregation, max_tokens=4)
        assert loss.item() == pytest.approx(value, rel=1e-6), aggregation


@pytest.mark.parametrize("aggregation", ["token", "sequence", "drgrpo"])
def test_each_aggregation_matches_the_loop_reference_on_ragged_masks(aggregation):
    for seed in range(3):
        log_probs, old, advantages, _, _ = random_batch(seed)
        log_probs.requires_grad_(True)
        batch = (log_probs, old, advantages, RAGGED_MASK)
        loss, stats = lm_grpo_loss(*batch, aggregation=aggregation, max_tokens=MAX_TOKENS)
        expected = reference_loss(
            log_probs.detach(), old, advantages, RAGGED_MASK, aggregation=aggregation, max_tokens=MAX_TOKENS
        )
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert 0 < stats["clip_frac"] < 1  # the batch does reach the clip, on some tokens only
        for name, value in reference_stats(log_probs.detach(), old, advantages, RAGGED_MASK).items():
            assert stats[name] == pytest.approx(value, rel=1e-9), name
        loss.backward()
        assert torch.isfinite(log_probs.grad).all()  # garbage padding (1e4, -inf) does not leak
        assert (log_probs.grad[RAGGED_MASK == 0] == 0).all()
        assert stats["tokens"] == RAGGED_MASK.sum().item()


def test_clip_higher_is_asymmetric():
    """DAPO: a ratio of 1.25 with A > 0 passes at clip_high 0.28 but not at a symmetric 0.2."""
    log_probs = torch.log(torch.tensor([[1.25]])).requires_grad_(True)
    old, mask, positive = torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([1.0])

    loss, stats = lm_grpo_loss(log_probs, old, positive, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and stats["clip_frac"] == 0.0
    (gradient,) = torch.autograd.grad(loss, log_probs)
    assert gradient.item() == pytest.approx(-1.25)  # d(-A r)/d logp = -A r: still learning

    loss, stats = lm_grpo_loss(log_probs, old, positive, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2) and stats["clip_frac"] == 1.0
    (gradient,) = torch.autograd.grad(loss, log_probs)
    assert gradient.item() == 0.0


def test_negative_advantages_clip_at_one_minus_clip_low():
    log_probs = torch.log(torch.tensor([[0.7, 0.85, 1.35]]))
    old, mask, negative = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([-1.0])
    loss, stats = lm_grpo_loss(log_probs, old, negative, mask, clip_low=0.2, clip_high=0.28)
    # max(r, clip(r)): 0.7 -> 0.8 (clipped, silenced); 0.85 -> 0.85; 1.35 -> 1.35 (upper clip is not pessimistic)
    assert loss.item() == pytest.approx((0.8 + 0.85 + 1.35) / 3)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    assert stats["ratio_min"] == pytest.approx(0.7) and stats["ratio_max"] == pytest.approx(1.35)
    # the same ratios with A > 0: only 1.35 > 1.28 is clipped, 0.7 keeps its (pessimistic) gradient
    _, stats = lm_grpo_loss(log_probs, old, -negative, mask, clip_low=0.2, clip_high=0.28)
    assert stats["clip_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "drgrpo"])
def test_on_policy_gradient_is_minus_advantage_times_grad_log_prob(aggregation):
    theta = torch.randn(RAGGED_MASK.shape, dtype=torch.float64, requires_grad=True)
    advantages = torch.randn(RAGGED_MASK.shape[0], dtype=torch.float64)
    loss, stats = lm_grpo_loss(
        theta, theta.detach(), advantages, RAGGED_MASK, aggregation=aggregation, max_tokens=MAX_TOKENS
    )
    assert stats["ratio_mean"] == stats["ratio_min"] == stats["ratio_max"] == 1.0
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0
    loss.backward()
    batch, total_tokens = len(RAGGED_MASK), RAGGED_MASK.sum().item()
    for b in range(batch):
        length = RAGGED_MASK[b].sum().item()
        for t in range(RAGGED_MASK.shape[1]):
            if RAGGED_MASK[b, t] == 0:
                expected = 0.0
            elif aggregation == "token":
                expected = -advantages[b].item() / total_tokens
            elif aggregation == "sequence":
                expected = -advantages[b].item() / (length * batch)
            else:
                expected = -advantages[b].item() / (batch * MAX_TOKENS)
            assert theta.grad[b, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_kl_estimators_against_hand_formulas():
    """log pi = log 0.5 against ref log 0.25, log 1 and log 0.125: d = ref - log pi = -log 2, log 2, -2 log 2."""
    log_2 = math.log(2.0)
    log_probs = torch.full((1, 4), math.log(0.5), requires_grad=True)
    ref = torch.tensor([[math.log(0.25), 0.0, math.log(0.125), 1e4]])  # the last token is padding: garbage
    zero, mask = torch.zeros(1), torch.tensor([[1.0, 1, 1, 0]])
    k1 = [log_2, -log_2, 2 * log_2]  # log pi - log ref: of either sign
    k3 = [0.5 + log_2 - 1, 2.0 - log_2 - 1, 0.25 + 2 * log_2 - 1]  # exp(d) - d - 1
    for estimator, per_token in [("k1", k1), ("k3", k3)]:
        kl_options = {"ref_log_probs": ref, "beta": 0.1, "kl_estimator": estimator}
        loss, stats = lm_grpo_loss(log_probs, log_probs.detach(), zero, mask, **kl_options)
        assert loss.item() == pytest.approx(0.1 * sum(per_token) / 3, rel=1e-6)
        assert stats["kl_ref"] == pytest.approx(sum(per_token) / 3, rel=1e-6)
    (gradient,) = torch.autograd.grad(loss, log_probs)
    torch.testing.assert_close(
        gradient, 0.1 * torch.tensor([[0.5, -1.0, 0.75, 0.0]]) / 3
    )  # d k3 / d log pi = 1 - exp(d)


def test_k3_is_never_negative():
    generator = torch.Generator().manual_seed(5)
    log_probs = torch.randn(40, 1, generator=generator) * 3
    ref = torch.randn(40, 1, generator=generator) * 3
    for i in range(len(log_probs)):
        one = log_probs[i : i + 1]
        _, stats = lm_grpo_loss(one, one, torch.zeros(1), torch.ones(1, 1), ref_log_probs=ref[i : i + 1])
        assert stats["kl_ref"] >= 0.0
    _, stats = lm_grpo_loss(ref, ref, torch.zeros(40), torch.ones(40, 1), ref_log_probs=ref)
    assert stats["kl_ref"] == 0.0


@pytest.mark.parametrize("aggregation", ["token", "sequence", "drgrpo"])
def test_summed_micro_batch_losses_equal_the_whole_batch(aggregation):
    """Every term on (surrogate, weights, KL, entropy); micro-batches of 2, 1 and 3 sequences."""
    log_probs, old, advantages, ref, entropy = random_batch(7)
    weight = torch.rand(RAGGED_MASK.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 2
    options = {"aggregation": aggregation, "max_tokens": MAX_TOKENS, "beta": 0.05, "entropy_coef": 0.01}
    options |= {"ref_log_probs": ref, "importance_weight": weight}

    def run(parts, loss_scale):
        theta, entropy_leaf = log_probs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
        total = 0.0
        for part in parts:
            per_part = {k: v[part] if isinstance(v, torch.Tensor) else v for k, v in options.items()}
            batch = (theta[part], old[part], advantages[part], RAGGED_MASK[part])
            loss, _ = lm_grpo_loss(*batch, entropy=entropy_leaf[part], loss_scale=loss_scale, **per_part)
            loss.backward()
            total += loss.item()
        return total, theta.grad, entropy_leaf.grad

    whole_loss, whole_grad, whole_entropy_grad = run([slice(0, 6)], None)
    assert whole_loss == pytest.approx(
        reference_loss(log_probs, old, advantages, RAGGED_MASK, entropy=entropy, **options), rel=1e-9
    )
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    summed_loss, summed_grad, summed_entropy_grad = run(parts, SCALE_OF_WHOLE_BATCH[aggregation](RAGGED_MASK))
    assert abs(summed_loss - whole_loss) <= 1e-6
    torch.testing.assert_close(summed_grad, whole_grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(summed_entropy_grad, whole_entropy_grad, rtol=0, atol=1e-6)
    if aggregation != "drgrpo":  # without loss_scale each micro-batch normalises by itself: not the same loss
        unscaled_loss, _, _ = run(parts, None)
        assert abs(unscaled_loss - whole_loss) > 1e-3


def test_importance_weight_from_decoupled_ppo_scales_each_token():
    """Stale samples: old = proximal (current, detached), weight = pi_prox / pi_behaviour capped at 2."""
    theta = torch.tensor([[0.3, -0.2, 0.1], [0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    behaviour = torch.tensor([[0.6, -0.4, -1.0], [0.4, 0.0, 0.0]])  # 0.1 - (-1.0) -> e^1.1 > cap
    advantages = torch.tensor([1.0, -2.0])
    old, weight = decoupled_old_log_prob(theta, behaviour, max_weight=2.0)
    loss, stats = lm_grpo_loss(theta, old, advantages, mask, importance_weight=weight)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
    expected = reference_loss(theta.detach(), old, advantages, mask, importance_weight=weight)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    capped = [[math.exp(0.3 - 0.6), math.exp(-0.2 + 0.4), 2.0], [math.exp(0.5 - 0.4), 0.0, 0.0]]
    for b in range(2):
        for t in range(3):
            expected_grad = -capped[b][t] * advantages[b].item() / 4 if mask[b, t] else 0.0
            assert theta.grad[b, t].item() == pytest.approx(expected_grad, rel=1e-6, abs=1e-9)


def test_entropy_bonus_is_subtracted_and_aggregated_like_the_surrogate():
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    entropy = torch.tensor([[1.0, 2.0, 99.0], [0.5, 0.5, 2.0]], requires_grad=True)
    zero = torch.zeros(2, 3)
    loss, stats = lm_grpo_loss(zero, zero, torch.zeros(2), mask, entropy=entropy, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.1 * 6.0 / 5)
    assert stats["entropy"] == pytest.approx(6.0 / 5)
    loss.backward()
    torch.testing.assert_close(entropy.grad, -0.1 * mask / 5)
    loss, _ = lm_grpo_loss(zero, zero, torch.zeros(2), mask, entropy=entropy, entropy_coef=0.1, aggregation="sequence")
    assert loss.item() == pytest.approx(-0.1 * (1.5 + 1.0) / 2)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"aggregation": "mean"}, "aggregation"),
        ({"aggregation": "drgrpo"}, "max_tokens"),
        ({"aggregation": "drgrpo", "max_tokens": 2}, "max_tokens"),  # shorter than a 3-token response
        ({"old_log_probs": torch.zeros(2, 4)}, "old_log_probs"),
        ({"mask": torch.ones(3, 3)}, "mask"),
        ({"mask": torch.full((2, 3), 0.5)}, "mask"),
        ({"mask": torch.zeros(2, 3)}, "mask"),
        ({"advantages": torch.zeros(2, 4)}, "advantages"),  # neither (B,) nor (B, T): (B, T) is GAE's per token
        ({"log_probs": torch.zeros(6), "old_log_probs": torch.zeros(6)}, "log_probs"),
        ({"ref_log_probs": torch.zeros(2, 2)}, "ref_log_probs"),
        ({"importance_weight": torch.ones(2)}, "importance_weight"),
        ({"entropy": torch.ones(1, 3)}, "entropy"),
        ({"beta": 0.1}, "ref_log_probs"),
        ({"entropy_coef": 0.1}, "entropy"),
        ({"kl_estimator": "k4", "ref_log_probs": torch.zeros(2, 3)}, "kl_estimator"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"loss_scale": 0.0}, "loss_scale"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(changes, named):
    arguments = {
        "log_probs": torch.zeros(2, 3),
        "old_log_probs": torch.zeros(2, 3),
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 3),
        **changes,
    }
    with pytest.raises(ValueError, match=named):
        lm_grpo_loss(**arguments)


def test_an_lm_steps_metrics_tell_the_loss_the_reward_spread_the_lengths_and_the_groups_without_signal():
    """`lm_step_metrics` against the figures computed here by hand: two prompts of three responses, one of them with
    equal rewards (no GRPO signal), trained in two parts whose summed losses and token counts add up."""
    from dovetail.graph.node import SampleId
    from dovetail.pipelines.lm.adapter import lm_step_metrics
    from dovetail.runtime.messages import Scores, Trained

    totals = np.array([1.0, 0.0, 0.5, 0.25, 0.25, 0.25])
    samples = [SampleId(3, prompt, member) for prompt in (0, 1) for member in range(3)]
    lengths = np.array([3, 8, 8, 1, 5, 8])
    scores = [
        Scores(samples[:4], {"total": totals[:4]}, lengths[:4]),
        Scores(samples[4:], {"total": totals[4:]}, lengths[4:]),
    ]
    stats = {"clip_frac": 0.5, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}
    trained = [
        Trained(samples[:3], [0] * 3, stats | {"loss": 6.0, "tokens": 30.0}, normaliser=30.0),
        Trained(samples[3:], [0] * 3, stats | {"loss": 2.0, "tokens": 10.0}, normaliser=10.0),
    ]
    metrics = lm_step_metrics(scores, trained, budget=8)
    assert metrics["loss"] == pytest.approx((6.0 + 2.0) / (30.0 + 10.0))
    assert metrics["completions/mean_length"] == pytest.approx(33 / 6)
    assert (metrics["completions/min_length"], metrics["completions/max_length"]) == (1.0, 8.0)
    assert metrics["completions/clipped_ratio"] == pytest.approx(3 / 6)  # the three that used all 8 tokens
    assert "completions/clipped_ratio" not in lm_step_metrics(scores, trained, budget=None)  # an env run's
    assert metrics["reward_std"] == pytest.approx(float(np.sqrt(np.mean((totals - totals.mean()) ** 2))))
    assert metrics["frac_reward_zero_std"] == 0.5
    assert metrics["reward/total"] == pytest.approx(totals.mean()) and metrics["response_tokens"] == 40.0
