"""PPO with a critic for language models (`algo.advantage: gae`): GAE and the clipped value loss against verl's
formulas, transcribed, on the same tensors (<= 1e-6) and against their closed forms; the critic's model; the config's
refusals; the critic's nodes in the planner's graph; a resumed run; verl-sync on Ray ending at the reference loop's
policy AND critic. A short PPO run that learns like GRPO is in tests/test_lm_algos.py, beside the other algorithms'.

verl's code transcribed here: verl/trainer/ppo/core_algos.py `compute_gae_advantage_return` (the version that skips
the masked tokens of a multi-turn response) and `compute_value_loss`, verl/utils/torch_functional.py `masked_whiten`,
`masked_mean` and `clip_by_value`.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from running import train
from safetensors.torch import load_file

from dovetail.algo import ADVANTAGE_ESTIMATORS, clipped_value_loss, gae_advantages_returns, lm_grpo_loss
from dovetail.config.common import ConfigError
from dovetail.config.load import load_config, parse_config
from dovetail.graph.lm import stage
from dovetail.graph.node import Kind, SampleId
from dovetail.models.critic import value_model_of
from dovetail.models.engine import Request
from dovetail.models.lm import load_lm
from dovetail.models.lm_rl import group_values, step_gae, value_gradient
from dovetail.pipelines.lm.config import LMAlgoSection
from dovetail.plan.metrics import summarize
from dovetail.plan.prepare import simulate

torch.set_num_threads(1)
SORT_YAML = Path(__file__).parents[1] / "configs" / "sort.yaml"
CALC_YAML = Path(__file__).parents[1] / "configs" / "calc.yaml"

# ------------------------------------------------------------------ upstream, transcribed


def verl_masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def verl_masked_whiten(values, mask):
    mean = verl_masked_mean(values, mask)
    variance = verl_masked_mean((values - mean) ** 2, mask)
    variance = variance * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """compute_gae_advantage_return."""
    with torch.no_grad():
        nextvalues = 0
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]
        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        advantages = verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def verl_value_loss(vpreds, returns, values, response_mask, cliprange_value):
    """compute_value_loss with loss_agg_mode 'token-mean'."""
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)  # clip_by_value
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * verl_masked_mean(clipped_vf_losses, response_mask)
    vf_clipfrac = verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


# ------------------------------------------------------------------ a batch of token rewards and values


def token_batch(seed: int, rows: int = 6, width: int = 9, holes: bool = False):
    """Rewards on each response's last token, values on its tokens (0 on padding, as verl's critic masks them), a
    right-padded mask; with `holes`, some tokens inside a response masked out (a trajectory's observations)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    if holes:
        mask[:, 1] = 0.0
    rewards = torch.zeros(rows, width, dtype=torch.float64)
    rewards[torch.arange(rows), lengths - 1] = torch.rand(rows, generator=generator, dtype=torch.float64)
    values = torch.randn(rows, width, generator=generator, dtype=torch.float64) * mask
    return rewards, values, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_equals_verls(seed, gamma, lam, holes):
    rewards, values, mask = token_batch(seed, holes=holes)
    ours, returns = gae_advantages_returns(rewards, values, mask.bool(), gamma=gamma, lam=lam)
    upstream, upstream_returns = verl_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(ours * mask, upstream * mask, atol=1e-6, rtol=0)
    torch.testing.assert_close(returns * mask, upstream_returns * mask, atol=1e-6, rtol=0)


def test_gae_with_gamma_and_lambda_one_is_the_reward_to_go_less_the_value():
    """gamma = lam = 1: R_t = sum_{k >= t} r_k (the reward-to-go: an outcome reward, on every token) and the
    advantage before whitening G_t - V_t; whitened, its token mean is 0 and its unbiased variance 1."""
    rewards, values, mask = token_batch(5)
    advantages, returns = gae_advantages_returns(rewards, values, mask.bool(), gamma=1.0, lam=1.0)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(returns, to_go, atol=1e-12, rtol=0)
    raw = (to_go - values)[mask.bool()]
    expected = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(advantages[mask.bool()], expected, atol=1e-12, rtol=0)
    assert (advantages[~mask.bool()] == 0).all() and (returns[~mask.bool()] == 0).all()


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    rewards, values, mask = token_batch(6)
    _, returns = gae_advantages_returns(rewards, values, mask.bool(), gamma=0.9, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    torch.testing.assert_close(returns, (rewards + 0.9 * next_values) * mask, atol=1e-12, rtol=0)


def test_gae_is_registered_as_a_whole_batch_estimator_that_reads_values():
    estimator = ADVANTAGE_ESTIMATORS["gae"]
    assert estimator.needs_values and estimator.whole_batch
    assert estimator.estimate is gae_advantages_returns


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cliprange_value", [0.05, 0.5, 10.0])
def test_clipped_value_loss_and_gradient_equal_verls(seed, cliprange_value):
    _, old, mask = token_batch(seed)
    generator = torch.Generator().manual_seed(100 + seed)
    returns = torch.randn(old.shape, generator=generator, dtype=torch.float64) * mask
    start = old + 0.3 * torch.randn(old.shape, generator=generator, dtype=torch.float64)
    ours_in, upstream_in = start.clone().requires_grad_(), start.clone().requires_grad_()
    loss, stats = clipped_value_loss(ours_in, old, returns, mask.bool(), cliprange_value=cliprange_value)
    upstream, clipfrac = verl_value_loss(upstream_in, returns, old, mask, cliprange_value)
    assert loss.item() == pytest.approx(upstream.item(), abs=1e-6)
    assert stats["vf_clipfrac"] == pytest.approx(clipfrac.item(), abs=1e-6)
    loss.backward()
    upstream.backward()
    torch.testing.assert_close(ours_in.grad, upstream_in.grad, atol=1e-6, rtol=0)


def test_a_value_pulled_past_the_clip_stops_being_pulled():
    """One token: old value 0, return 1, clip 0.2. At 0.5 (past the clip, toward the return) the clipped error
    (1 - 0.2)^2 is the larger: a constant, so no gradient; at 0.1 (inside) the loss is 0.5 (V - R)^2, gradient V - R."""
    mask = torch.ones(1, 1, dtype=torch.bool)
    old, target = torch.zeros(1, 1), torch.ones(1, 1)
    for value, gradient, loss_value in ((0.5, 0.0, 0.5 * 0.8**2), (0.1, -0.9, 0.5 * 0.9**2)):
        v = torch.full((1, 1), value, requires_grad=True)
        loss, _ = clipped_value_loss(v, old, target, mask, cliprange_value=0.2)
        loss.backward()
        assert loss.item() == pytest.approx(loss_value) and v.grad.item() == pytest.approx(gradient)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_per_token_advantages_weigh_each_tokens_surrogate(aggregation):
    """`lm_grpo_loss` with (B, T) advantages: equal to the (B,) path where every token of a sequence has its
    sequence's advantage, and otherwise each token's gradient is its own advantage's (on policy, ratio 1, token
    aggregation: d loss / d log pi_t = -A_t / tokens)."""
    _, _, mask = token_batch(7, rows=4, width=5)
    generator = torch.Generator().manual_seed(7)
    log_probs = (torch.randn(mask.shape, generator=generator, dtype=torch.float64) - 1).requires_grad_()
    per_sequence = torch.randn(4, generator=generator, dtype=torch.float64)
    broadcast = per_sequence[:, None].expand(mask.shape).clone()
    old = log_probs.detach()
    a, _ = lm_grpo_loss(log_probs, old, per_sequence, mask.bool(), aggregation=aggregation)
    b, _ = lm_grpo_loss(log_probs, old, broadcast, mask.bool(), aggregation=aggregation)
    assert a.item() == pytest.approx(b.item(), abs=1e-12)
    per_token = torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    loss, _ = lm_grpo_loss(log_probs, old, per_token, mask.bool(), aggregation="token")
    loss.backward()
    torch.testing.assert_close(log_probs.grad, -per_token * mask / mask.sum(), atol=1e-12, rtol=0)


# ------------------------------------------------------------------ the critic


def test_the_critic_is_the_policys_body_with_a_fresh_seeded_head():
    policy, _, _ = load_lm(SORT_YAML.parents[1] / "dovetail" / "assets" / "sort-lm")
    critic = value_model_of(policy, seed=0)
    body = policy.model.state_dict()
    assert critic.body.state_dict().keys() == body.keys()
    assert all(torch.equal(critic.body.state_dict()[k], body[k]) for k in body)
    again, other = value_model_of(policy, seed=0), value_model_of(policy, seed=1)
    assert torch.equal(critic.head.weight, again.head.weight) and not torch.equal(critic.head.weight, other.head.weight)
    assert (critic.head.bias == 0).all() and 0.01 < critic.head.weight.std().item() < 0.04  # N(0, 0.02^2)
    assert critic.body.embed_tokens.weight.data_ptr() != policy.model.embed_tokens.weight.data_ptr(), "its own copy"


def test_a_tokens_value_is_read_where_its_log_prob_is():
    """Response token j's value is the head on the policy body's last hidden state at the position that predicts it
    (prompt length - 1 + j), computed here from the causal LM's own hidden states."""
    policy, _, _ = load_lm(SORT_YAML.parents[1] / "dovetail" / "assets" / "sort-lm")
    critic = value_model_of(policy, seed=3)
    prompt, responses = [1, 7, 9, 4], [[5, 6, 2], [8]]
    values, mask = group_values(critic, prompt, responses)
    assert mask.tolist() == [[True, True, True], [True, False, False]]
    with torch.no_grad():
        for row, response in enumerate(responses):
            hidden = policy(input_ids=torch.tensor([prompt + response]), output_hidden_states=True).hidden_states[-1]
            expected = critic.head(hidden[0, len(prompt) - 1 : len(prompt) - 1 + len(response)]).squeeze(-1)
            torch.testing.assert_close(values[row, : len(response)], expected, atol=1e-5, rtol=0)


def test_a_ppo_devices_memory_counts_the_critic_beside_the_policy():
    """The memory figures a step reports count the critic's parameters with the policy's (4 bytes each, fp32)."""
    from dovetail.pipelines.lm.engines import LMEngines

    held = {}
    for name, overrides in {"grpo": [], "ppo": ["algo.advantage=gae", "critic.lr=1e-4"]}.items():
        engines = LMEngines(load_config(None, ["kind=lm", *overrides]), torch.device("cpu"), True, None)
        held[name] = engines.memory().parameters
    critic = value_model_of(load_lm(load_config(None, ["kind=lm"]).builtin_checkpoint)[0], 0)
    assert held["ppo"] - held["grpo"] == 4 * sum(p.numel() for p in critic.parameters())


def test_a_users_transformers_model_gets_its_critic_the_same_way(tmp_path):
    """A `model.path` policy (a Qwen2 saved with save_pretrained): its critic is its transformers body with a fresh
    head, and a token's value is read where its log-prob is."""
    from test_user_lm import save_tiny_model

    from dovetail.models.causal_lm import load_causal_lm

    policy = load_causal_lm(save_tiny_model(tmp_path / "qwen2", "qwen2"), lora=None, seed=0)
    critic = value_model_of(policy, seed=0)
    body = policy.model.model.state_dict()
    assert all(torch.equal(critic.body.state_dict()[k], body[k]) for k in body)
    prompt, response = [3, 4, 5], [6, 7]
    values, _ = group_values(critic, prompt, [response])
    with torch.no_grad():
        hidden = policy(input_ids=torch.tensor([prompt + response]), output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(values[0], critic.head(hidden[0, 2:4]).squeeze(-1), atol=1e-5, rtol=0)


def verl_apply_kl_penalty(token_level_scores, old_log_prob, ref_log_prob, response_mask, beta, kind):
    """apply_kl_penalty (fixed controller): the KL penalty on each token's reward."""
    kld = verl_kl_penalty(old_log_prob, ref_log_prob, kind) * response_mask
    return token_level_scores - beta * kld


def verl_kl_penalty(logprob, ref_logprob, kind):
    """kl_penalty: 'kl' (k1), 'mse' (k2), 'low_var_kl' (k3, clamped to +-10)."""
    if kind == "kl":
        return logprob - ref_logprob
    if kind == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


@pytest.mark.parametrize(("ours", "verls"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_in_the_reward_goes_on_each_token_as_verls_apply_kl_penalty(ours, verls):
    """`algo.kl_in: reward` with GAE: each token's reward less beta x its KL estimate at the old log-probs, then GAE,
    equal to verl's apply_kl_penalty followed by compute_gae_advantage_return on the same tensors."""
    algo = LMAlgoSection(advantage="gae", kl_in="reward", beta=0.3, kl_estimator=ours, gamma=0.9, lam=0.8)
    algo.adv_clip = 1000.0
    samples = [SampleId(0, p, i) for p in range(2) for i in range(2)]
    generator = torch.Generator().manual_seed(11)
    lengths = [3, 1, 4, 2]
    tokens = [list(range(5, 5 + n)) for n in lengths]
    requests = {s: Request(tuple(s), [1, 2], t, [0.0] * len(t), True) for s, t in zip(samples, tokens)}
    rewards = dict(zip(samples, [1.0, 0.0, 0.5, 0.25]))
    per_sample = {
        name: {s: -torch.rand(n, generator=generator, dtype=torch.float64).numpy() for s, n in zip(samples, lengths)}
        for name in ("old", "ref", "values")
    }
    gae = step_gae(
        rewards, requests, per_sample["values"], per_sample["old"], per_sample["ref"], algo=algo, max_new_tokens=8
    )
    mask = (torch.arange(4)[None, :] < torch.tensor(lengths)[:, None]).double()

    def padded(values):
        out = torch.zeros(4, 4, dtype=torch.float64)
        for row, sample in enumerate(samples):
            out[row, : lengths[row]] = torch.as_tensor(values[sample])
        return out

    scores = torch.zeros(4, 4, dtype=torch.float64)
    scores[torch.arange(4), torch.tensor(lengths) - 1] = torch.tensor([rewards[s] for s in samples]).double()
    token_rewards = verl_apply_kl_penalty(
        scores, padded(per_sample["old"]), padded(per_sample["ref"]), mask, 0.3, verls
    )
    advantages, returns = verl_gae(token_rewards, padded(per_sample["values"]), mask, 0.9, 0.8)
    for row, sample in enumerate(samples):
        ours_advantages, ours_returns = gae[sample]
        torch.testing.assert_close(
            torch.as_tensor(ours_returns).double(), returns[row, : lengths[row]], atol=1e-6, rtol=0
        )
        torch.testing.assert_close(
            torch.as_tensor(ours_advantages).double(), advantages[row, : lengths[row]], atol=1e-6, rtol=0
        )


def test_step_gae_puts_the_shaped_reward_on_the_last_token():
    """The pipeline's GAE over a scored step, gamma = lam = 1: each token's return is its response's reward (the
    overlong penalty added), whatever the values."""
    algo = LMAlgoSection(advantage="gae", overlong_buffer=2, adv_clip=1000)
    samples = [SampleId(0, p, i) for p in range(2) for i in range(2)]
    tokens = [[5, 6], [5, 6, 7, 8], [9], [9, 9, 9]]
    requests = {s: Request(tuple(s), [1, 2], t, [0.0] * len(t), True) for s, t in zip(samples, tokens)}
    rewards = dict(zip(samples, [1.0, 0.0, 0.5, 0.25]))
    values = {s: torch.randn(len(t)).numpy() for s, t in zip(samples, tokens)}
    gae = step_gae(rewards, requests, values, {}, {}, algo=algo, max_new_tokens=4)
    for sample, response in zip(samples, tokens):
        penalty = min(0.0, -(len(response) - 2) / 2)
        assert gae[sample][1].tolist() == pytest.approx([rewards[sample] + penalty] * len(response))


def trajectories(seed: int):
    """A scored step of multi-turn trajectories: each a model turn, an observation, a model turn (its `generated`
    mask False on the observation), a reward, a value per token, and its rows as verl's padded tensors."""
    generator = torch.Generator().manual_seed(seed)
    samples = [SampleId(0, p, i) for p in range(2) for i in range(3)]
    requests, generated, rewards, values = {}, {}, {}, {}
    for sample in samples:
        turns = torch.randint(1, 4, (3,), generator=generator).tolist()
        flags = [True] * turns[0] + [False] * turns[1] + [True] * turns[2]
        tokens = torch.randint(3, 9, (len(flags),), generator=generator).tolist()
        requests[sample] = Request(tuple(sample), [1, 2], tokens, [0.0] * len(tokens), True)
        generated[sample] = flags
        rewards[sample] = float(torch.rand((), generator=generator))
        values[sample] = torch.randn(len(flags), generator=generator, dtype=torch.float64).float().numpy()
    width = max(len(f) for f in generated.values())
    token_rewards, token_values, mask = (torch.zeros(len(samples), width, dtype=torch.float64) for _ in range(3))
    for row, sample in enumerate(samples):
        length = len(generated[sample])
        token_rewards[row, length - 1] = rewards[sample]  # verl's reward manager: the response's last token
        token_values[row, :length] = torch.as_tensor(values[sample]).double()
        mask[row, :length] = torch.tensor(generated[sample], dtype=torch.float64)
    return samples, requests, generated, rewards, values, (token_rewards, token_values, mask)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_trajectorys_gae_is_verls_over_the_tokens_the_model_sampled(seed):
    """A multi-turn step's GAE (`step_gae` with the trajectories' `generated` masks) is verl's multi-turn GAE with
    the observations out of its `response_mask`: the same advantages and returns on every sampled token, 0 on an
    observation's."""
    samples, requests, generated, rewards, values, verls = trajectories(seed)
    algo = LMAlgoSection(advantage="gae", gamma=0.9, lam=0.95, adv_clip=1000)
    gae = step_gae(rewards, requests, values, {}, {}, algo=algo, max_new_tokens=16, generated=generated)
    token_rewards, token_values, mask = verls
    advantages, returns = verl_gae(token_rewards, token_values, mask, 0.9, 0.95)
    for row, sample in enumerate(samples):
        length, sampled = len(generated[sample]), torch.tensor(generated[sample])
        ours_advantages, ours_returns = (torch.as_tensor(a).double() for a in gae[sample])
        torch.testing.assert_close(ours_advantages[sampled], advantages[row, :length][sampled], atol=1e-6, rtol=0)
        torch.testing.assert_close(ours_returns[sampled], returns[row, :length][sampled], atol=1e-6, rtol=0)
        assert (ours_advantages[~sampled] == 0).all() and (ours_returns[~sampled] == 0).all()


def test_an_observations_values_move_neither_the_advantages_nor_the_critics_gradient():
    """The critic's values on an observation's tokens are read by no TD error and trained toward no return: changed
    at will, the step's advantages and the critic's gradient keep their bits; read as sampled tokens (no mask), they
    move both."""
    samples, requests, generated, rewards, values, _ = trajectories(2)
    scrambled = {s: v.copy() for s, v in values.items()}
    for sample in samples:
        scrambled[sample][~torch.tensor(generated[sample]).numpy()] = 7.0
    algo = LMAlgoSection(advantage="gae", gamma=1.0, lam=0.95, adv_clip=1000)
    config = load_config(None, RAY_SMALL)
    critic = value_model_of(load_lm(config.builtin_checkpoint)[0], config.seed)

    def outcome(of_values, masks):
        gae = step_gae(rewards, requests, of_values, {}, {}, algo=algo, max_new_tokens=16, generated=masks)
        gradient, _ = value_gradient(
            critic,
            requests,
            rewards,
            of_values,
            {},
            {},
            algo=algo,
            cliprange_value=0.5,
            max_new_tokens=16,
            generated=masks,
        )
        return torch.cat([torch.as_tensor(gae[s][0]) for s in samples]), gradient

    kept, moved = outcome(values, generated), outcome(scrambled, generated)
    assert torch.equal(kept[0], moved[0]) and torch.equal(kept[1], moved[1])
    unmasked, unmasked_scrambled = outcome(values, None), outcome(scrambled, None)
    assert not torch.equal(unmasked[0], unmasked_scrambled[0])
    assert not torch.equal(unmasked[1], unmasked_scrambled[1])


# ------------------------------------------------------------------ the config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.advantage=gae"], "critic: algo.advantage=gae trains a critic; add the section"),
        (["critic.lr=1e-4"], "critic: only algo.advantage=gae trains a critic (it is grpo); remove the section"),
        (
            ["policy=areal", "algo.advantage=gae", "critic.lr=1e-4"],
            "algo.advantage=gae whitens over the whole step: set algo.micro_batches=1",
        ),
        (
            ["policy=verl-sync", "algo.advantage=gae", "critic.lr=1e-4"],
            "algo.advantage=gae whitens over the whole step: set algo.micro_batches=1",
        ),
        (["algo.advantage=gae", "critic.cliprange_value=0"], "critic.cliprange_value"),
    ],
)
def test_a_ppo_config_the_run_cannot_honour_is_one_line_naming_the_fix(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["kind=lm", *overrides])
    assert message in str(error.value) and "\n" not in str(error.value).strip()


def test_the_critic_steps_at_its_own_lr_after_its_own_warm_up():
    """`critic_train`: the critic's lr rises linearly over critic.warmup_steps, then stays at critic.lr whatever the
    policy's schedule; the clip is the policy's."""
    from dovetail.models.training import scheduled_lr

    config = load_config(
        None,
        ["kind=lm", "algo.advantage=gae", "critic.lr=3e-4", "critic.warmup_steps=4", "train.lr_schedule=cosine"],
    )
    critic = config.critic_train
    assert [scheduled_lr(critic, step) for step in (0, 2, 4, 150)] == pytest.approx([0.0, 1.5e-4, 3e-4, 3e-4])
    assert critic.max_grad_norm == config.train.max_grad_norm and config.train.lr_schedule == "cosine"


# ------------------------------------------------------------------ the planner's graph


def ppo_scenario(critic: bool):
    config = load_config(
        SORT_YAML,
        ["algo.micro_batches=1", *(["algo.advantage=gae", "critic.lr=1e-4"] if critic else [])],
    )
    return config.scenario(2)


def test_the_graph_has_a_value_pass_and_a_critic_train_priced_beside_the_actors():
    """Each micro-batch's value pass follows its score and precedes both trains; the critic's train is a train
    node of the critic beside the actor's, both before the commit, priced like the actor's passes; the planner
    imports no torch to build them (tests/test_layers.py holds the imports)."""
    from dovetail.plan.prepare import prepare

    with_critic, without = (prepare(ppo_scenario(c), "verl-sync") for c in (True, False))
    graph = with_critic.graph
    values = [n for n in graph if n.kind == Kind.LOGPROB and n.critic]
    critics = [n for n in graph if n.kind == Kind.TRAIN and n.critic]
    actors = [n for n in graph if n.kind == Kind.TRAIN and not n.critic]
    assert len(values) == len(critics) == len(actors) == 2  # a micro-batch, two steps
    for value, critic, actor in zip(values, critics, actors):
        assert graph[value.deps[0]].kind == Kind.SCORE and value.id in critic.deps and value.id in actor.deps
        assert (stage(value), stage(critic)) == ("values", "critic")
        assert critic.cost_s == actor.cost_s > value.cost_s > 0
        commit = next(n for n in graph.of(actor.pipeline, actor.step, Kind.COMMIT))
        assert {critic.id, actor.id} <= set(commit.deps)
    plain = without.graph
    assert not any(n.critic for n in plain)
    commits = [next(iter(g.of(g.pipelines()[0], 0, Kind.COMMIT))) for g in (graph, plain)]
    assert commits[0].cost_s > commits[1].cost_s, "the critic's optimizer step is priced at the commit"


def test_simulate_shows_the_critics_nodes_and_their_time():
    """The simulator runs the critic's nodes under verl-sync (its stages in verl's order) and reports their phases
    (`dovetail simulate --json`'s phase_seconds, a Gantt's colours) as the value pass and the critic's train; the
    step takes longer by their predicted time, and the actor's train keeps its own."""
    metrics = {c: summarize(simulate(ppo_scenario(c), "verl-sync")[1]) for c in (True, False)}
    phases = {c: m.phase_seconds for c, m in metrics.items()}
    assert phases[True]["values"] > 0 and phases[True]["train_critic"] > 0
    assert not {"values", "train_critic"} & set(phases[False])
    assert phases[True]["train"] == pytest.approx(phases[False]["train"])
    assert metrics[True].step_time_s > metrics[False].step_time_s


# ------------------------------------------------------------------ runs


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
    "algo.advantage=gae",
    "algo.gamma=0.99",
    "algo.lam=0.95",
    "critic.lr=1e-3",
    "critic.cliprange_value=0.2",
    "critic.warmup_steps=1",
]


def test_a_resumed_ppo_run_goes_on_with_its_critic(tmp_path):
    """The reference loop, 2 steps at once or 1 and a resume: the critic and its AdamW state travel in the
    checkpoint (`critic.safetensors`, `critic_optimizer.pt`), so both runs end at the same policy and critic."""
    overrides = [*RAY_SMALL, "policy=reference", "checkpoint.every=1"]
    train(load_config(None, overrides), tmp_path / "whole", steps=2)
    train(load_config(None, overrides), tmp_path / "resumed", steps=1)
    train(load_config(None, overrides), tmp_path / "resumed", steps=2, resume=tmp_path / "resumed")
    for name in ("model.safetensors", "critic.safetensors"):
        ends = [load_file(str(tmp_path / p / "checkpoints" / "step_000002" / name)) for p in ("whole", "resumed")]
        assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0]), name


def test_the_critic_trains_alone_for_its_first_steps_then_the_actor_joins(tmp_path):
    """critic.steps_before_actor=2 (verl's trainer.critic_warmup): after steps 1 and 2 the policy is the base model
    to the bit while the critic moved (step 1's critic is the one a run without the warm-up has: the actor does not
    enter the critic's update); step 3 moves the policy."""
    overrides = [*RAY_SMALL, "policy=reference", "checkpoint.every=1"]
    train(load_config(None, [*overrides, "critic.steps_before_actor=2"]), tmp_path / "alone", steps=3)
    train(load_config(None, overrides), tmp_path / "together", steps=1)
    base = load_file(str(load_config(None, RAY_SMALL).model.checkpoint / "model.safetensors"))

    def saved(run: str, step: int, name: str) -> dict:
        return load_file(str(tmp_path / run / "checkpoints" / f"step_{step:06d}" / name))

    for step in (1, 2):
        policy = saved("alone", step, "model.safetensors")
        assert all(torch.equal(policy[k], base[k]) for k in base), step
    assert not all(torch.equal(saved("alone", 3, "model.safetensors")[k], base[k]) for k in base)
    first, second = saved("alone", 1, "critic.safetensors"), saved("alone", 2, "critic.safetensors")
    assert any(not torch.equal(first[k], second[k]) for k in first), "the critic trained in step 2"
    without = saved("together", 1, "critic.safetensors")
    assert all(torch.equal(first[k], without[k]) for k in first)
    lines = [json.loads(line) for line in (tmp_path / "alone" / "metrics.jsonl").read_text().splitlines()]
    assert [m["grad_norm"] == 0.0 for m in lines] == [True, True, False]


@pytest.fixture(scope="module")
def reference_ppo(tmp_path_factory) -> Path:
    """The reference loop's 3-step PPO run of `RAY_SMALL`."""
    out = tmp_path_factory.mktemp("reference-ppo")
    train(load_config(None, [*RAY_SMALL, "policy=reference"]), out, steps=3)
    return out


def ends(out: Path, name: str) -> dict:
    return load_file(str(out / "checkpoints" / "step_000003" / name))


@pytest.mark.exactness
@pytest.mark.parametrize("policy", ["verl-sync", pytest.param("jigsaw", marks=pytest.mark.slow)])
def test_an_on_policy_ray_run_trains_policy_and_critic_to_the_reference_parameters(
    policy, local_ray, reference_ppo, tmp_path
):
    """PPO reaches a Ray policy as it reaches the reference loop: on 2 devices, each training a share of the step's
    groups (the value pass and the critic's train shared out as the actor's), verl-sync and jigsaw end at the
    reference loop's policy and critic to the bit, both moved by training."""
    train(load_config(None, [*RAY_SMALL, f"policy={policy}"]), tmp_path, steps=3)
    for name in ("model.safetensors", "critic.safetensors"):
        expected, got = ends(reference_ppo, name), ends(tmp_path, name)
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), name
    start = load_file(str(load_config(None, RAY_SMALL).model.checkpoint / "model.safetensors"))
    policy_end = ends(reference_ppo, "model.safetensors")
    assert max((policy_end[k] - start[k]).abs().max().item() for k in start) > 1e-4, "training moved the policy"
    critic_end = ends(reference_ppo, "critic.safetensors")
    config = load_config(None, RAY_SMALL)
    critic_start = value_model_of(load_lm(config.builtin_checkpoint)[0], config.seed).state_dict()
    assert critic_end.keys() == critic_start.keys()
    moved = max((critic_end[k] - critic_start[k]).abs().max().item() for k in critic_start)
    assert moved > 1e-4, "training moved the critic"


SHARDED_BOUND = 0.1 * 1e-3
"""tests/test_sharded_runtime.py's bound on a sharded fp32 run's distance from the reference (a tenth of one step's
move at the lr, 1e-3 here for the policy and the critic alike): FSDP adds the members' gradients in fp32."""


@pytest.mark.slow
@pytest.mark.exactness
def test_a_sharded_ppo_run_trains_policy_and_critic_to_the_reference_parameters_and_resumes(
    local_ray, reference_ppo, tmp_path
):
    """train.sharding: fsdp under verl-sync on 2 devices: the critic is sharded over the policy's FSDP group (each
    member holds half of both models and of their AdamW moments), values the step's tokens and trains on its
    shards; the run ends at the reference loop's policy and critic within the sharded bound, and a resume from its
    step-2 checkpoint (the members' shards joined, cut again) ends at its bits."""
    sharded = [*RAY_SMALL, "policy=verl-sync", "train.sharding=fsdp", "checkpoint.every=2"]
    train(load_config(None, sharded), tmp_path / "whole", steps=3)
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_000002"
    train(load_config(None, sharded), tmp_path / "resumed", steps=3, resume=checkpoint)
    for name in ("model.safetensors", "critic.safetensors"):
        expected, got, resumed = (
            ends(reference_ppo, name),
            ends(tmp_path / "whole", name),
            ends(tmp_path / "resumed", name),
        )
        assert expected.keys() == got.keys() == resumed.keys(), name
        assert max((expected[k] - got[k]).abs().max().item() for k in expected) < SHARDED_BOUND, name
        assert all(torch.equal(got[k], resumed[k]) for k in got), name
        at_two = load_file(str(checkpoint / name))
        assert any(not torch.equal(got[k], at_two[k]) for k in got), f"{name}: step 3 trained"
    config = load_config(None, RAY_SMALL)
    policy = load_lm(config.builtin_checkpoint)[0]
    whole = 4 * sum(p.numel() for model in (policy, value_model_of(policy, config.seed)) for p in model.parameters())
    lines = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    halves = [member["parameters"] for member in lines[-1]["memory_bytes_per_device"]]
    assert len(halves) == 2 and sum(halves) == whole and max(halves) < 0.51 * whole
    assert all(m["critic/vf_loss"] > 0 for m in lines)


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "bound"), [("streamrl", 1), ("areal", 4)])
def test_an_asynchronous_ppo_run_bounds_its_staleness_and_trains_every_response_and_value_once(
    policy, bound, local_ray, reference_ppo, tmp_path
):
    """Under streamrl and areal the critic trains beside the actor as under verl-sync: the first step, rolled out
    on the base weights, is the reference's (its rewards, policy loss and value loss); later steps may roll out on
    older weights than they train, within the policy's bound, and every response is valued, scored and trained once."""
    summary = train(load_config(None, [*RAY_SMALL, f"policy={policy}"]), tmp_path, steps=3)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = json.loads((reference_ppo / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("reward/total", "critic/vf_loss", "critic/vpred_mean", "loss"):
        assert lines[0][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    assert all(0 <= m["staleness"] <= bound for m in lines) and max(m["staleness"] for m in lines) >= 1
    assert summary["max_staleness"] <= bound and all(m["critic/vf_loss"] > 0 for m in lines)
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    units = [entry["unit"] for entry in ledger["trained"]]
    assert ledger["problems"] == [] and sorted(set(units)) == [0, 1]  # the actor's unit and the critic's
    assert units.count(0) == units.count(1) == 3 * 4 * 4


@pytest.mark.slow
@pytest.mark.exactness
def test_a_multi_turn_ppo_run_on_ray_trains_policy_and_critic_to_the_reference_parameters(local_ray, tmp_path):
    """PPO on the agentic calc task (trajectories of model turns and tool observations): verl-sync on 2 devices ends
    at the reference loop's policy and critic to the bit, the critic moved by training."""
    calc = yaml.safe_load(CALC_YAML.read_text())
    small = calc | {
        "algo": {"prompts_per_step": 4, "group_size": 4, "micro_batches": 1, "advantage": "gae", "lam": 0.95},
        "critic": {"lr": 1e-3},
        "eval": {"prompts": 4, "every": 100},
        "runtime": {"profile_samples": 4},
        "train": {"lr": 1e-3},
    }
    for policy in ("reference", "verl-sync"):
        train(parse_config(small | {"policy": policy}), tmp_path / policy, steps=2)
    for name in ("model.safetensors", "critic.safetensors"):
        ends = [load_file(str(tmp_path / p / "checkpoints" / "step_000002" / name)) for p in ("reference", "verl-sync")]
        assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0]), name
    lines = (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line)["env/tool_calls"] > 0 for line in lines), "the trajectories held tool observations"
    config = parse_config(small | {"policy": "reference"})
    critic_start = value_model_of(load_lm(config.model.checkpoint)[0], config.seed).state_dict()
    critic_end = load_file(str(tmp_path / "reference" / "checkpoints" / "step_000002" / "critic.safetensors"))
    assert max((critic_end[k] - critic_start[k]).abs().max().item() for k in critic_start) > 1e-4


@pytest.mark.slow
@pytest.mark.exactness
def test_several_updates_a_batch_and_dynamic_sampling_train_the_critic_on_ray_as_in_the_reference(local_ray, tmp_path):
    """algo.num_iterations=2 (verl's ppo_epochs for actor and critic: GAE once, then two updates of each on the same
    returns) with DAPO's dynamic sampling (the groups kept from several draws valued and trained, by the critic as by
    the actor): verl-sync on 2 devices, a step cut into its draws, ends at the reference loop's policy and critic to
    the bit; each step reports its second update's value loss, and the critic ends elsewhere than after one update
    a step."""
    both = [*RAY_SMALL, "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_draws=3"]
    runs = {
        (policy, updates): tmp_path / f"{policy}-{updates}"
        for policy, updates in (("reference", 2), ("verl-sync", 2), ("reference", 1))
    }
    for (policy, updates), out in runs.items():
        train(load_config(None, [*both, f"policy={policy}", f"algo.num_iterations={updates}"]), out, steps=3)
    for name in ("model.safetensors", "critic.safetensors"):
        expected, got = ends(runs["reference", 2], name), ends(runs["verl-sync", 2], name)
        assert all(torch.equal(expected[k], got[k]) for k in expected), name
    twice, once = ends(runs["reference", 2], "critic.safetensors"), ends(runs["reference", 1], "critic.safetensors")
    assert any(not torch.equal(twice[k], once[k]) for k in twice), "the second update moved the critic"
    for key in (("reference", 2), ("verl-sync", 2)):
        lines = [json.loads(line) for line in (runs[key] / "metrics.jsonl").read_text().splitlines()]
        assert all(line["update_2/critic/vf_loss"] > 0 for line in lines), key
        assert max(m["dynamic_sampling/draws"] for m in lines) > 1 and max(m["dynamic_sampling/dropped"] for m in lines)
