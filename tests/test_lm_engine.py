"""TorchEngine against Hugging Face Llama, and the properties the runtime relies on: a request's tokens
do not depend on its batch, on continuous batching, on pausing, or on migrating to another engine."""

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
from dovetail.models.lm_rl import response_log_probs

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


def test_response_log_probs_carry_gradients(model):
    log_probs, mask = response_log_probs(model, PROMPTS[:2], [[4, 5], [6]], 1.0)
    log_probs[mask].sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad()


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
