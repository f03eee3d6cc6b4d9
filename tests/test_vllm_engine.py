"""Rollouts on vLLM (`sampling.engine: vllm`, `models.vllm_engine`) on its CPU build: `make test-vllm` runs this file
in the environment that has it (`.venv-vllm`); the project's own environment skips it at collection.

A tiny random-init Llama (head_dim 32: vLLM's CPU attention refuses 16) is checked against the trainer's own
computation: a publication reaches vLLM's running model (greedy decoding after it is transformers' greedy decode of
the new weights), the engine's log-probs are the trainer's up to the kernels' rounding, its tokens are our engine's
(the same keyed draws), a request exported from one vLLM engine continues token for token on another, sleep / wake
keep it working, and the model trains 2 GRPO steps under `reference` and `verl-sync` with the trainer's recomputed
old log-probs and the gap reported. Multi-turn: an episode's turns on vLLM are our engine's, each within its turn's
budget, and a user's model trains an env run on vLLM rollouts."""

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import yaml  # noqa: E402
from running import train  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_multiturn import CHATTY, env_config  # noqa: E402
from test_user_lm import REWARDS, char_tokenizer, sums, tiny_model  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from dovetail.config.load import load_config  # noqa: E402
from dovetail.envs.contract import Latency  # noqa: E402
from dovetail.envs.host import EnvironmentHost  # noqa: E402
from dovetail.graph.node import SampleId  # noqa: E402
from dovetail.models.causal_lm import HFTokenizer  # noqa: E402
from dovetail.models.engine import Request, SamplingParams, TorchEngine  # noqa: E402
from dovetail.models.lm_rl import response_log_probs  # noqa: E402
from dovetail.models.vllm_engine import VllmEngine  # noqa: E402
from dovetail.pipelines.lm.multiturn import Conversation, run_episodes  # noqa: E402

MAX_LEN = 96
PROMPTS = [[1, 9, 10, 19, 11], [1, 12, 13], [1, 9, 10, 19, 11], [1, 30, 31, 32, 33, 34]]


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """`test_user_lm`'s tiny Llama with heads of 32 (vLLM's CPU attention refuses 16), its weights drawn from `seed`."""
    model, _ = tiny_model("llama", seed=seed, head_dim=32)
    return model


SAMPLED = SamplingParams(max_new_tokens=10, stop_ids=(2,), seed=3)
GREEDY = SamplingParams(max_new_tokens=10, stop_ids=(2,), seed=3, top_p=1e-6)


@pytest.fixture(scope="module")
def engines():
    """Two vLLM engines built once (as a run builds its own), started from one model's weights."""
    first, second = (VllmEngine(tiny_llama(0).config, SAMPLED, max_len=MAX_LEN) for _ in range(2))
    yield first, second
    first.close()
    second.close()


def requests() -> list[Request]:
    return [Request((0, i // 2, i % 2), prompt) for i, prompt in enumerate(PROMPTS)]


def test_a_publication_reaches_vllm_in_place_and_greedy_decoding_is_the_trainers(engines):
    engine, _ = engines
    llm = engine.llm
    for seed in (0, 1):  # the first weights, then another model's published over them
        trainer = tiny_llama(seed)
        engine.load_weights(trainer.state_dict())
        assert engine.llm is llm  # updated in place, not rebuilt
        engine.params = GREEDY  # the same running vLLM, asked greedily
        try:
            ours = [r.tokens for r in engine.generate(requests())]
        finally:
            engine.params = SAMPLED
        with torch.no_grad():
            for prompt, tokens in zip(PROMPTS, ours):
                decoded = trainer.generate(
                    torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False, eos_token_id=2, pad_token_id=0
                )
                assert decoded[0, len(prompt) :].tolist() == tokens
        if seed == 0:
            before = ours
    assert ours != before  # the second publication changed what vLLM computes


def test_vllm_samples_with_the_trainer_s_log_probs_whatever_the_batch(engines):
    engine, _ = engines
    trainer = tiny_llama(1)
    engine.load_weights(trainer.state_dict())
    results = engine.generate(requests())
    assert results[0].tokens != results[2].tokens  # one prompt, two sample keys: two draws
    with torch.no_grad():
        log_probs, mask = response_log_probs(trainer, PROMPTS, [r.tokens for r in results], 1.0)
    for row, result in enumerate(results):
        assert len(result.tokens) == len(result.log_probs) > 0
        torch.testing.assert_close(
            torch.tensor(result.log_probs, dtype=torch.float64), log_probs[row][mask[row]].double(), atol=1e-4, rtol=0
        )
    alone = engine.generate([requests()[3]])  # a request's tokens do not depend on its batch
    assert alone[0].tokens == results[3].tokens


def test_a_request_exported_from_one_vllm_engine_continues_token_for_token_on_another(engines):
    """Paused at 3 tokens, exported, re-prefilled on the other engine: the tokens it gets unpaused, which are our
    engine's (every token drawn with our keyed uniform from vLLM's logits)."""
    first, second = engines
    trainer = tiny_llama(1)
    for engine in engines:
        engine.load_weights(trainer.state_dict())
    unpaused = first.generate(requests())
    ours = TorchEngine.from_model(trainer, SAMPLED, max_len=MAX_LEN).generate(requests())
    assert [r.tokens for r in unpaused] == [r.tokens for r in ours]
    paused = first.generate(requests(), until=3)
    assert all(len(r.tokens) == 3 for r in paused if not r.finished) and not all(r.finished for r in paused)
    exported = [first.export(r.key) for r in paused if not r.finished]
    migrated = {r.key: r for r in second.generate(exported)}
    for whole in unpaused:
        if whole.key in migrated:
            assert migrated[whole.key].tokens == whole.tokens
            assert migrated[whole.key].log_probs[:3] == whole.log_probs[:3]  # the ledger's first tokens kept
    with torch.no_grad():
        log_probs, mask = response_log_probs(trainer, PROMPTS, [r.tokens for r in unpaused], 1.0)
    for row, result in enumerate(unpaused):
        torch.testing.assert_close(
            torch.tensor(result.log_probs, dtype=torch.float64), log_probs[row][mask[row]].double(), atol=1e-4, rtol=0
        )


def test_sleep_and_wake_keep_the_engine_working_and_generating_wakes_a_sleeping_engine(engines):
    """On CPU vLLM has no sleep mode (both are no-ops there); on a GPU (benchmarks/gpu_check) they free and restore
    its memory. Either way the tokens stay the same, and a sleeping engine asked to generate wakes first."""
    engine, _ = engines
    engine.load_weights(tiny_llama(1).state_dict())
    before = engine.generate(requests())
    engine.sleep()
    engine.wake()
    assert [r.tokens for r in engine.generate(requests())] == [r.tokens for r in before]
    engine.sleep()
    assert engine.sleeping
    assert [r.tokens for r in engine.generate(requests())] == [r.tokens for r in before]
    assert not engine.sleeping


TURNS = SamplingParams(max_new_tokens=40, stop_ids=(2,), seed=3, max_turn_tokens=3)
"""A trajectory's budget, turns and observations together, and each turn's."""


@pytest.fixture
def chatty_host(tmp_path, monkeypatch):
    """tests/test_multiturn.py's environment that keeps every trajectory three turns."""
    (tmp_path / "chatty_envs.py").write_text(CHATTY)
    monkeypatch.syspath_prepend(str(tmp_path))
    host = EnvironmentHost("chatty_envs:Chatty", {}, "plain", Latency(), seed=0, timeout_s=30)
    yield host
    host.stop()


def test_a_multi_turn_rollout_on_vllm_is_our_engines_turn_for_turn(engines, chatty_host, tmp_path):
    """Three turns a trajectory with the environment's "more:" between them, written by the model's chat template:
    vLLM decodes each turn from where its trajectory stands to the turn's budget and draws our engine's tokens, with
    the trainer's log-probs, whatever waits and batches."""
    engine, _ = engines
    trainer = tiny_llama(1)
    engine.load_weights(trainer.state_dict())
    conversation = Conversation(env_config(tmp_path), HFTokenizer(char_tokenizer(), (2,), tmp_path), (), MAX_LEN)
    samples = [SampleId(3, p, i) for p in range(2) for i in range(2)]
    rows = [{"question": question} for question in ("sort dcba:", "sort dcba:", "sort zyx:", "sort zyx:")]
    engine.params = TURNS
    try:
        on_vllm, _ = run_episodes(engine, chatty_host, conversation, samples, rows)
    finally:
        engine.params = SAMPLED
    ours, _ = run_episodes(
        TorchEngine.from_model(trainer, TURNS, max_len=MAX_LEN), chatty_host, conversation, samples, rows
    )
    assert [t.tokens for t in on_vllm] == [t.tokens for t in ours]
    for trajectory in on_vllm:
        assert trajectory.done and trajectory.turns == 3
        assert [segment.sampled for segment in trajectory.segments] == [True, False, True, False, True]
        assert all(1 <= len(segment.tokens) <= 3 for segment in trajectory.segments[::2])  # the turn's budget
    with torch.no_grad():
        prompts = [conversation.prompt(row["question"]) for row in rows]
        log_probs, mask = response_log_probs(trainer, prompts, [t.tokens for t in on_vllm], 1.0)
    for row, trajectory in enumerate(on_vllm):
        sampled = torch.tensor(trajectory.generated)
        torch.testing.assert_close(
            torch.tensor(trajectory.log_probs, dtype=torch.float64)[sampled],
            log_probs[row][mask[row]].double()[sampled],
            atol=1e-4,
            rtol=0,
        )


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("workspace")
    tiny_llama(0).save_pretrained(root / "my-llama")
    char_tokenizer().save_pretrained(root / "my-llama")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums(0, 8)))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums(8, 1)))
    (root / "myrewards.py").write_text(REWARDS)
    config = {
        "kind": "lm",
        "model": {"path": str(root / "my-llama")},
        "prompts": {"path": str(root / "train.jsonl"), "eval_path": str(root / "test.jsonl")},
        "reward": {"myrewards:correct": 1.0, "answer_match": 1.0, "length_penalty": 0.5},
        "sampling": {"max_new_tokens": 8, "engine": "vllm"},
        "algo": {"prompts_per_step": 2, "group_size": 4, "micro_batches": 1},
        "eval": {"prompts": 2, "every": 100},
        "train": {"lr": 3e-3},
        "checkpoint": {"every": 100},
        "runtime": {"profile_samples": 2},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    return root


@pytest.mark.parametrize("policy", ["reference", "verl-sync"])
def test_a_user_model_trains_two_grpo_steps_on_vllm_rollouts(policy, workspace, local_ray, tmp_path):
    """The old log-probs are the trainer's recomputed ones (the ratio is 1 on policy), the engine's are within the
    kernels' rounding of them (`logprob_gap`), and every weight trained."""
    config = load_config(workspace / "run.yaml", [f"policy={policy}"])
    assert config.scenario(2).pipelines[0].recompute_logprob
    train(config, tmp_path, steps=2)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for line in lines:
        assert 0 <= line["logprob_gap"] < 1e-3 and line["response_tokens"] > 0
        assert abs(line["ratio_mean"] - 1) < 1e-6
    start = load_file(workspace / "my-llama" / "model.safetensors")
    trained = load_file(tmp_path / "checkpoints" / "step_000002" / "model.safetensors")
    assert min((trained[k] - start[k]).abs().max().item() for k in start) > 0  # every tensor moved
    if policy != "reference":  # the Ray runtime's sample ledger: every sample generated, scored, trained once
        assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []


@pytest.mark.parametrize("policy", ["reference", "verl-sync"])
def test_a_user_model_trains_an_env_run_on_vllm_rollouts(policy, workspace, local_ray, tmp_path):
    """The built-in arithmetic environment (its calculator behind `<calc>` tags) on a user's model whose rollouts vLLM
    decodes: episodes are reported, the trainer's recomputed old log-probs are within the kernels' rounding of vLLM's
    and the weights move. Under verl-sync it runs on the warm workers of the single-turn runs above, whose processes
    built a vLLM engine before joining those runs' device groups: each builds another."""
    rows = [{"question": f"{a}*{b}=", "answer": str(a * b)} for a in range(11, 15) for b in range(21, 23)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [f"policy={policy}", "env.name=arithmetic", "env.parser=plain", "env.options.max_turns=2"]
    overrides += [f"prompts.path={tmp_path / 'rows.jsonl'}", f"prompts.eval_path={tmp_path / 'rows.jsonl'}"]
    overrides += ["prompts.prompt_field=question", "prompts.max_tokens=16", "sampling.max_new_tokens=24"]
    train(load_config(workspace / "run.yaml", overrides), tmp_path / "run", steps=2)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for line in lines:
        assert 0 <= line["logprob_gap"] < 1e-3 and line["response_tokens"] > 0 and line["env/turns"] >= 1
    start = load_file(workspace / "my-llama" / "model.safetensors")
    trained = load_file(tmp_path / "run" / "checkpoints" / "step_000002" / "model.safetensors")
    assert max((trained[k] - start[k]).abs().max().item() for k in start) > 0
