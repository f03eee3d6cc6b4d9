"""The FlowGRPO / DanceGRPO math against closed forms and independent recomputation."""

import math
import statistics

import pytest
import torch

from dovetail.algo import flow_grpo_loss, group_advantages, sde_step, select_train_timesteps

torch.manual_seed(0)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo", "cps"])
def test_log_prob_is_the_mean_gaussian_density(kind):
    v, x = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    sigma, sigma_next = torch.tensor([1.0, 0.8, 0.5, 0.3]), torch.tensor([0.8, 0.6, 0.3, 0.1])
    step = sde_step(v, x, sigma, sigma_next, noise_level=0.7, kind=kind, generator=torch.Generator().manual_seed(1))
    std = step.std.view(-1, 1, 1, 1)
    expected = torch.distributions.Normal(step.mean, std).log_prob(step.prev_latents).mean(dim=(1, 2, 3))
    torch.testing.assert_close(step.log_prob, expected, rtol=1e-6, atol=1e-6)
    assert step.log_prob.shape == (4,) and step.std.shape == (4,)


def test_flow_grpo_step_matches_the_design_formulas():
    v, x = torch.randn(2, 3), torch.randn(2, 3)
    a = 0.7
    for sigma, sigma_next in [(1.0, 0.9), (0.6, 0.45)]:
        step = sde_step(v, x, sigma, sigma_next, noise_level=a, kind="flow_grpo", noise=torch.zeros(2, 3))
        dt = sigma_next - sigma
        denominator = 1 - (sigma_next if sigma == 1.0 else sigma)  # at sigma = 1 the next sigma stands in
        std_t = a * math.sqrt(sigma / denominator)
        mean = x + v * dt + std_t**2 / (2 * sigma) * (x + (1 - sigma) * v) * dt
        torch.testing.assert_close(step.mean, mean)
        torch.testing.assert_close(step.std, torch.full((2,), std_t * math.sqrt(-dt)))
        torch.testing.assert_close(step.prev_latents, mean)  # zero noise lands on the mean


def test_dance_grpo_uses_a_constant_std_and_the_same_drift():
    v, x = torch.randn(2, 3), torch.randn(2, 3)
    flow = sde_step(v, x, 0.5, 0.4, noise_level=0.3, kind="flow_grpo", noise=torch.zeros(2, 3))
    dance = sde_step(v, x, 0.5, 0.4, noise_level=0.3 * math.sqrt(0.5 / 0.5), kind="dance_grpo", noise=torch.zeros(2, 3))
    # at sigma = 0.5, a*sqrt(sigma/(1-sigma)) = a: both SDEs coincide there
    torch.testing.assert_close(flow.mean, dance.mean)
    torch.testing.assert_close(dance.std, torch.full((2,), 0.3 * math.sqrt(0.1)))


def test_cps_keeps_the_ode_marginal_coefficients():
    """With the true velocity of a point x0 with noise n, CPS's mean + noise keeps (1-s') x0 + s' n_total."""
    x0, n = torch.randn(3, 4), torch.randn(3, 4)
    sigma, sigma_next = 0.7, 0.4
    x = (1 - sigma) * x0 + sigma * n
    step = sde_step(n - x0, x, sigma, sigma_next, noise_level=0.5, kind="cps", noise=torch.zeros(3, 4))
    std = sigma_next * math.sin(0.5 * math.pi / 2)
    torch.testing.assert_close(step.mean, (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * n)


def test_scoring_given_latents_reproduces_sampling_so_on_policy_ratio_is_exactly_one():
    v, x = torch.randn(5, 1, 4, 4), torch.randn(5, 1, 4, 4)
    sampled = sde_step(v, x, 0.8, 0.7, noise_level=0.7)
    scored = sde_step(v, x, 0.8, 0.7, noise_level=0.7, prev_latents=sampled.prev_latents)
    assert torch.equal(scored.log_prob, sampled.log_prob)
    _, stats = flow_grpo_loss(scored.log_prob, sampled.log_prob, torch.randn(5), clip_range=1e-4)
    assert stats["ratio_mean"] == stats["ratio_min"] == stats["ratio_max"] == 1.0
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0


def test_step_is_computed_in_fp32_whatever_the_input_dtype():
    v, x = torch.randn(2, 4).bfloat16(), torch.randn(2, 4).bfloat16()
    step = sde_step(v, x, 0.5, 0.4, noise_level=0.7)
    assert step.prev_latents.dtype == step.log_prob.dtype == torch.float32


def test_advantages_equal_hand_computed_values_in_every_scope():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    eps = 1e-4
    std_g0 = math.sqrt(2 / 3)  # population std of 1, 2, 3
    group = group_advantages(rewards, groups, std_scope="group", eps=eps)
    torch.testing.assert_close(group, torch.tensor([-1 / (std_g0 + eps), 0.0, 1 / (std_g0 + eps), 0.0, 0.0, 0.0]))

    mean_all = sum([1, 2, 3, 10, 10, 4]) / 6
    std_all = math.sqrt(sum((r - mean_all) ** 2 for r in [1, 2, 3, 10, 10, 4]) / 6)
    glob = group_advantages(rewards, groups, std_scope="global", eps=eps)
    torch.testing.assert_close(glob, torch.tensor([-1, 0, 1, 0, 0, 0]) / (std_all + eps))

    none = group_advantages(rewards, groups, std_scope="none")
    torch.testing.assert_close(none, torch.tensor([-1.0, 0, 1, 0, 0, 0]))

    unbiased = group_advantages(rewards, groups, std_scope="group", eps=0.0, unbiased=True)
    torch.testing.assert_close(unbiased[:3], torch.tensor([-1.0, 0, 1]))  # sample std of 1, 2, 3 is 1


def test_advantages_are_clipped():
    rewards = torch.tensor([0.0] * 99 + [1.0])
    adv = group_advantages(rewards, torch.zeros(100), clip=5.0)
    assert adv.max().item() == 5.0


def test_clipped_surrogate_against_hand_values():
    log_prob = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, stats = flow_grpo_loss(log_prob, old, adv, clip_range=0.2)
    # max(-A r, -A clip(r)): [-1*1.5 vs -1*1.2] -> -1.2 ; [0.5 vs 0.8] -> 0.8 ; [-2 vs -2] -> -2
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["ratio_max"] == pytest.approx(1.5) and stats["ratio_min"] == pytest.approx(0.5)


def test_kl_term_is_the_closed_form_gaussian_kl():
    mean, ref = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    std = torch.tensor([0.5, 1.0, 2.0, 0.1]).view(-1, 1, 1)
    zero = torch.zeros(4)
    loss, stats = flow_grpo_loss(zero, zero, zero, clip_range=1e-4, ref_mean=ref, mean=mean, std=std, beta=0.5)
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std), torch.distributions.Normal(ref, std))
    assert loss.item() == pytest.approx(0.5 * kl.mean(dim=(1, 2)).mean().item(), rel=1e-5)


def test_timestep_selection_never_trains_the_last_step():
    assert select_train_timesteps(10, fraction=0.5) == [0, 1, 2, 3, 4]
    assert select_train_timesteps(10, fraction=1.0) == list(range(9))
    random = select_train_timesteps(10, fraction=0.6, mode="random", generator=torch.Generator().manual_seed(3))
    assert len(random) == 6 and random == sorted(set(random)) and max(random) <= 8
    for seed in range(20):
        window = select_train_timesteps(
            10, fraction=1.0, mode="window", window=3, generator=torch.Generator().manual_seed(seed)
        )
        assert window == list(range(window[0], window[0] + 3)) and window[-1] <= 8
    with pytest.raises(ValueError, match="window"):
        select_train_timesteps(10, fraction=1.0, mode="window", window=10)
    with pytest.raises(ValueError, match="mode"):
        select_train_timesteps(10, fraction=0.5, mode="suffix")


def test_decoupled_correction_is_a_truncated_importance_weighted_policy_gradient():
    """Stale samples: clip around the current policy, weight by pi_prox / pi_behaviour (capped)."""
    from dovetail.algo import decoupled_old_log_prob

    theta = torch.tensor([0.3, -0.2, 0.1], requires_grad=True)
    log_prob = theta * 2.0  # d log_prob / d theta = 2
    behaviour = torch.tensor([0.6, -0.4, -1.0])  # 0.2 - 1.0 -> weight e^1.2 > cap
    advantages = torch.tensor([1.0, -2.0, 0.5])
    old, weight = decoupled_old_log_prob(log_prob, behaviour, max_weight=2.0)
    assert torch.equal(old, log_prob.detach())
    expected_weight = torch.exp(log_prob.detach() - behaviour).clamp(max=2.0)
    assert torch.equal(weight, expected_weight) and weight[2].item() == 2.0
    loss, stats = flow_grpo_loss(log_prob, old, advantages, clip_range=1e-4, importance_weight=weight)
    loss.backward()
    torch.testing.assert_close(theta.grad, -expected_weight * advantages * 2.0 / 3)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0


@pytest.mark.parametrize("eps", [0.0, -0.0, 1e-4])
@pytest.mark.parametrize("std_scope", ["group", "global", "none"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_a_group_whose_rewards_are_all_equal_gets_exactly_zero_whatever_eps(eps, std_scope, unbiased):
    """r - mean = 0 exactly, as TRL and verl give it; 13/997 three times is a mean a rounded sum misses by an ulp."""
    rewards = torch.tensor([1.0, 1.0, 13 / 997, 13 / 997, 13 / 997, 0.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    advantages = group_advantages(rewards, groups, std_scope=std_scope, eps=eps, unbiased=unbiased)
    assert advantages[:5].tolist() == [0.0] * 5
    values = rewards.tolist()
    scale = {
        "group": (statistics.stdev if unbiased else statistics.pstdev)([0.0, 1.0]) + eps,
        "global": (statistics.stdev if unbiased else statistics.pstdev)(values) + eps,
        "none": 1.0,
    }[std_scope]
    torch.testing.assert_close(advantages[5:], torch.tensor([-0.5, 0.5]) / scale)
    same = group_advantages(torch.full((4,), 0.3), torch.tensor([0, 0, 1, 1]), std_scope=std_scope, eps=eps)
    assert same.tolist() == [0.0] * 4
    batch = group_advantages(torch.full((4,), 0.3), torch.tensor([0, 0, 1, 1]), baseline="batch", eps=eps)
    assert batch.tolist() == [0.0] * 4
