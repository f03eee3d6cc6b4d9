"""TorchEngine against Hugging Face Llama, and the properties the runtime relies on: a request's tokens
do not depend on its batch, on continuous batching, on pausing, or on migrating to another engine."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dovetail.models.engine import (
    LlamaWeights,
    Request,
    SamplingParams,
    TorchEngine,
    keyed_uniforms,
    sample_tokens,
)
from dovetail.models.lm import load_lm
from dovetail.models.lm_rl import group_response_log_probs, response_log_probs
from dovetail.tasks import task

VOCAB = 40
PROMPTS = [[1, 5, 9], [3], [7, 7, 2, 30, 11, 4, 8], [12, 13], [39, 0, 21, 22, 5], [6, 6, 6, 6], [17], [25, 26, 27]]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def requests(prompts=PROMPTS, step=3) -> list[Request]:
    return [Request((step, index, 0), list(prompt)) for index, prompt in enumerate(prompts)]


def engine(model, max_batch=8, **params) -> TorchEngine:
    defaults = {"temperature": 1.0, "max_new_tokens": 24, "seed": 11}
    return TorchEngine.from_model(model, SamplingParams(**{**defaults, **params}), max_batch=max_batch)


def assert_same(results: list[Request], expected: list[Request]) -> None:
    assert [r.key for r in results] == [r.key for r in expected]
    for result, reference in zip(results, expected):
        assert result.tokens == reference.tokens
        assert result.finished == reference.finished
        torch.testing.assert_close(torch.tensor(result.log_probs), torch.tensor(reference.log_probs), atol=1e-5, rtol=0)


def test_own_forward_matches_hf_logits(model):
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    weights = LlamaWeights(model.config, model.state_dict(), max_len=64)
    keys, values = torch.zeros(2, 3, 2, 16, 64), torch.zeros(2, 3, 2, 64, 16)
    hidden = weights.forward(ids, torch.zeros(3, dtype=torch.long), keys, values)
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(weights.logits(hidden), expected, atol=1e-5, rtol=0)


def test_greedy_matches_hf_generate(model):
    results = engine(model, top_p=1e-9, max_new_tokens=12).generate(requests())
    model.generation_config.eos_token_id = None
    for result, prompt in zip(results, PROMPTS):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # an explicit mask: HF would mask prompt tokens equal to pad_token_id
            output = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        assert result.tokens == output[0, len(prompt) :].tolist()


def test_tokens_do_not_depend_on_batch_position_or_neighbours(model):
    batch = engine(model).generate(requests())
    alone = engine(model).generate(requests()[2:3])
    reversed_order = engine(model).generate(requests()[::-1])
    other_neighbours = requests([[9, 9]] * 7 + [PROMPTS[2]])
    other_neighbours[-1].key = (3, 2, 0)
    mixed = engine(model).generate(other_neighbours)
    assert_same(alone, batch[2:3])
    assert_same(reversed_order[::-1], batch)
    assert_same(mixed[-1:], batch[2:3])
    assert len({tuple(r.tokens) for r in batch}) == len(batch)  # the keys, not a shared stream, drive the draws


def test_continuous_batching_gives_the_same_tokens(model):
    many = requests(PROMPTS * 2)
    full = engine(model, max_batch=16, stop_ids=(5,)).generate(many)
    assert {len(r.tokens) for r in full} != {24}  # some leave early, so others join mid-flight
    assert_same(engine(model, max_batch=3, stop_ids=(5,)).generate(many), full)


def test_pause_and_resume_on_the_same_engine_reuses_the_cache(model):
    reference = engine(model).generate(requests())
    paused_engine = engine(model)
    paused = paused_engine.generate(requests(), until=10)
    assert all(len(r.tokens) == 10 and not r.finished for r in paused)
    prefilled = paused_engine.prefill_tokens
    resumed = paused_engine.generate(paused_engine.generate(paused, until=17))
    assert_same(resumed, reference)
    assert paused_engine.prefill_tokens == prefilled


def test_evicted_requests_are_re_prefilled_with_the_same_tokens(model):
    reference = engine(model).generate(requests(PROMPTS * 2))
    small = TorchEngine.from_model(model, engine(model).params, max_batch=2, num_slots=3)
    results = requests(PROMPTS * 2)
    for until in (5, 9, None):
        results = small.generate(results, until=until)
    assert small.prefill_tokens > sum(len(prompt) - 1 for prompt in PROMPTS * 2)  # some were evicted
    assert_same(results, reference)


def test_migrated_request_continues_token_for_token(model):
    reference = engine(model, temperature=0.7, top_p=0.9).generate(requests())
    source = engine(model, temperature=0.7, top_p=0.9)
    source.generate(requests(), until=7)
    exported = [source.export(r.key) for r in requests()]
    assert source.paused == {} and all(owner is None for owner in source.slot_owner)
    destination = engine(model, max_batch=3, temperature=0.7, top_p=0.9)
    assert_same(destination.generate(exported), reference)


def test_identical_prompts_are_computed_once_with_the_same_tokens(model):
    many = requests(PROMPTS * 3)
    shared = engine(model, max_batch=24)
    results = shared.generate(many)
    assert_same(results[8:16], engine(model).generate(many[8:16]))  # no duplicate in the batch: computed
    assert_same(results[16:], engine(model).generate(many[16:]))
    assert shared.prefill_tokens == 3 * sum(len(prompt) - 1 for prompt in PROMPTS)  # positions cached, copies too


def test_stop_ids_and_max_new_tokens(model):
    free = engine(model, max_new_tokens=20).generate(requests())
    assert all(len(r.tokens) == 20 and r.finished for r in free)
    stop = free[0].tokens[4]
    stopped = engine(model, max_new_tokens=20, stop_ids=(stop,)).generate(requests())
    for result, unstopped in zip(stopped, free):
        end = unstopped.tokens.index(stop) + 1 if stop in unstopped.tokens else 20
        assert result.finished and result.tokens == unstopped.tokens[:end]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_log_probs_equal_trainer_log_probs(model, temperature):
    results = engine(model, temperature=temperature, top_p=0.8).generate(requests())
    with torch.no_grad():
        log_probs, mask = response_log_probs(model, PROMPTS, [r.tokens for r in results], temperature)
    for row, result in enumerate(results):
        assert mask[row].sum() == len(result.tokens)
        expected = torch.tensor(result.log_probs, dtype=torch.float32)
        torch.testing.assert_close(log_probs[row, : len(result.tokens)], expected, atol=1e-5, rtol=0)


SORT_LM = Path(__file__).resolve().parents[1] / "dovetail" / "assets" / "sort-lm"
# What the engine sampled from the shipped sort-lm before its decode step was optimised, for the first 64 train
# prompts of the sort task (seed 0), keys (1, i, 0), sampling seed 3: the first three sequences, the sha256 of
# json.dumps of all 64 token lists, and the sum of all their log-probs. Retraining the asset changes them.
PINNED = {
    (1.0, 1.0): (
        [[21, 29, 32, 41, 43, 46, 51, 23, 2], [21, 27, 29, 31, 37, 42, 13, 2], [21, 38, 40, 44, 49, 50, 23, 2]],
        "2de0ba270ee2c8e48d8604690c5a08f76e073ae10d927b4948e0f97e00b0ebc2",
        -469.0960975324766,
    ),
    (0.7, 0.9): (
        [
            [21, 29, 32, 41, 43, 46, 51, 23, 2],
            [21, 27, 29, 31, 37, 42, 43, 44, 46, 50, 51, 23, 2],
            [21, 30, 32, 33, 37, 38, 40, 44, 49, 50, 23, 2],
        ],
        "fdaeb7f1c778a1fbf509beb7819c6c4cb8e6aa2fa0e4541660c0ceac52cc76dd",
        -11.40338978737228,
    ),
    (1.5, 0.95): (
        [[21, 29, 16, 2], [21, 29, 31, 37, 37, 40, 28, 29, 0, 2], [21, 39, 40, 45, 49, 52, 23, 2]],
        "a30b6c683792000ea5991a2782916c18c2efce77df58278828ae29cff0341a55",
        -1002.1292927278232,
    ),
}


@pytest.fixture(scope="module")
def sort_lm():
    torch.set_num_threads(1)
    model, tokenizer, _ = load_lm(SORT_LM)
    prompts = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in task("sort").prompts("train", 0, 0, 64)]
    return model, tokenizer, prompts


@pytest.mark.parametrize(("temperature", "top_p"), list(PINNED))
@pytest.mark.parametrize("max_batch", [64, 7])
def test_shipped_model_samples_the_pinned_tokens(sort_lm, temperature, top_p, max_batch):
    model, tokenizer, prompts = sort_lm
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=task("sort").max_new_tokens,
        stop_ids=(tokenizer.eos_id,),
        seed=3,
    )
    results = TorchEngine.from_model(model, params, max_batch=max_batch).generate(
        [Request((1, index, 0), list(prompt)) for index, prompt in enumerate(prompts)]
    )
    first, digest, log_prob_sum = PINNED[temperature, top_p]
    assert [r.tokens for r in results[:3]] == first
    assert hashlib.sha256(json.dumps([r.tokens for r in results]).encode()).hexdigest() == digest
    assert all(r.finished for r in results)
    assert sum(sum(r.log_probs) for r in results) == pytest.approx(log_prob_sum, abs=1e-4)


def test_response_log_probs_carry_gradients(model):
    log_probs, mask = response_log_probs(model, PROMPTS[:2], [[4, 5], [6]], 1.0)
    log_probs[mask].sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad()


@pytest.mark.parametrize("responses", [[[4, 5, 9], [6], [30, 31, 2, 8, 8], [6]], [[4], [12]]])
def test_a_group_passes_its_prompt_once_and_gets_the_padded_batch_s_log_probs_and_gradient(model, responses):
    """The shared-prompt pass (the prompt alone, then the responses on its cache) against the padded batch of prompt +
    response rows: the same log-probs, entropies and gradient up to fp32 rounding; a group of one-token responses
    never runs the second pass."""
    prompt, temperature = PROMPTS[2], 0.7
    results = {}
    for name, log_probs_of in {
        "batch": lambda: response_log_probs(model, [prompt] * len(responses), responses, temperature, entropy=True),
        "group": lambda: group_response_log_probs(model, prompt, responses, temperature, entropy=True),
    }.items():
        model.zero_grad(set_to_none=True)
        log_probs, mask, entropy = log_probs_of()
        weights = torch.linspace(-1.0, 1.0, log_probs.numel()).view_as(log_probs)
        ((log_probs * weights)[mask].sum() + entropy[mask].sum()).backward()
        gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        results[name] = (log_probs.detach(), mask, entropy.detach(), gradient)
    model.zero_grad(set_to_none=True)
    (batch_lp, batch_mask, batch_entropy, batch_grad), (lp, mask, entropy, grad) = results["batch"], results["group"]
    assert torch.equal(mask, batch_mask)
    torch.testing.assert_close(lp, batch_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy, batch_entropy, atol=2e-5, rtol=0)
    assert grad.abs().max() > 1e-2
    torch.testing.assert_close(grad, batch_grad, atol=1e-5 * batch_grad.abs().max().item(), rtol=1e-4)


def numpy_keyed_uniforms(seed: int, keys: list, positions: list[int]) -> torch.Tensor:
    """The definition of the keyed draws, on numpy uint64 (the engine computes it on torch int64 bits)."""
    golden = np.uint64(0x9E3779B97F4A7C15)

    def splitmix64(z):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    parts = np.array([[seed, *key, position] for key, position in zip(keys, positions)], dtype=np.int64)
    state = np.full(len(parts), golden, dtype=np.uint64)
    for column in parts.astype(np.uint64).T:
        state = splitmix64(state ^ splitmix64(column + golden))
    return torch.from_numpy((state >> np.uint64(12)).astype(np.float64) * 2.0**-52 + 2.0**-53)


def test_keyed_uniforms_equal_the_numpy_definition_bit_for_bit():
    generator = np.random.default_rng(0)
    edges = [0, 1, 2**31, 2**32 - 1, 2**62, 2**63 - 1, -1, -(2**63)]
    for _ in range(20):
        count = int(generator.integers(1, 200))
        values = generator.integers(-(2**63), 2**63 - 1, size=(count, 4), dtype=np.int64, endpoint=True).tolist()
        values += [[edges[(i + j) % len(edges)] for j in range(4)] for i in range(len(edges))]
        seed = int(generator.integers(-(2**63), 2**63 - 1, endpoint=True))
        keys, positions = [tuple(v[:3]) for v in values], [v[3] for v in values]
        assert torch.equal(keyed_uniforms(seed, keys, positions), numpy_keyed_uniforms(seed, keys, positions))


def keyed_draws(logits: torch.Tensor, count: int, top_p: float) -> torch.Tensor:
    keys = [(0, i, j) for i in range(count // 100) for j in range(100)]
    u = keyed_uniforms(5, keys, [3] * len(keys))
    tokens, _ = sample_tokens(logits.expand(len(keys), -1), u, 1.0, top_p)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_keyed_sampler_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]])
    counts = keyed_draws(logits, 20_000, top_p=1.0)
    assert chi_square(counts, logits.double().softmax(-1)[0]) < 24.3  # chi2(7 dof) 0.999 quantile


def test_top_p_keeps_the_nucleus_and_drops_the_tail():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]])
    probs = logits.double().softmax(-1)[0]  # by prob: 0 (.36), 7 (.22), 1 (.13), 2 (.08), ...
    nucleus = [0, 7, 1]
    counts = keyed_draws(logits, 20_000, top_p=float(probs[nucleus[:2]].sum()) + 0.01)
    assert counts[nucleus].sum() == counts.sum()
    assert chi_square(counts[nucleus], probs[nucleus] / probs[nucleus].sum()) < 13.8  # chi2(2 dof) 0.999


def test_keyed_uniforms_are_in_the_open_interval_and_depend_on_every_part():
    keys = [(1, 2, 3), (1, 2, 3), (1, 2, 4), (1, 3, 3), (2, 2, 3)]
    u = keyed_uniforms(0, keys, [0, 1, 0, 0, 0])
    assert ((u > 0) & (u < 1)).all()
    assert len(set(u.tolist())) == len(keys)
    assert keyed_uniforms(1, keys[:1], [0]) != u[0]
    assert torch.equal(keyed_uniforms(0, keys[::-1], [0, 0, 0, 1, 0]), u.flip(0))


def test_a_device_switched_to_training_puts_its_rollout_engine_to_sleep_and_any_other_role_wakes_it(monkeypatch):
    """A colocated policy's role switch reaches the rollout engine (`LMEngines.hold`): vLLM's sleep mode then hands
    its memory to the trainer (`VllmEngine.sleep`, tested on vLLM in test_vllm_engine.py)."""
    from dovetail.config.load import load_config
    from dovetail.pipelines.lm.engines import LMEngines

    engines = LMEngines(
        load_config(Path(__file__).parents[1] / "configs/sort.yaml", []), torch.device("cpu"), True, None
    )
    calls: list[str] = []
    monkeypatch.setattr(engines.rollout, "sleep", lambda: calls.append("sleep"))
    monkeypatch.setattr(engines.rollout, "wake", lambda: calls.append("wake"))
    for role in ("trainer", "rollout", "trainer", "any"):
        engines.hold(role)
    assert calls == ["sleep", "wake", "sleep", "wake"]
