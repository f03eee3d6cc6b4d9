"""A user's own language model, dataset and rewards (`kind: lm` with `model.path` and `prompts.path`): tiny random-init
transformers models (Llama, Qwen2, Qwen3, Mistral on our engine; GPT-2 on transformers' own forward) with a character
tokenizer and chat template made here, saved with save_pretrained; a jsonl of prompts and answers; a reward module
beside the config that reads the `answer` column. A user model trains under `reference` and `verl-sync` to the same
bits, LoRA trains, publishes and checkpoints the adapter alone, `dovetail export` writes what `AutoModelForCausalLM`
loads and generates from, and bad inputs are one line."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel, get_peft_model_state_dict
from running import train
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5EncoderModel,
)
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.models.causal_lm import HFTokenizer, StopStrings, load_causal_lm, rollout_engine
from dovetail.models.critic import value_model_of
from dovetail.models.engine import Request, SamplingParams, TorchEngine, TransformersEngine
from dovetail.models.lm import load_tokenizer
from dovetail.models.lm_rl import response_log_probs
from dovetail.pipelines.lm.model import encode_prompts
from dovetail.pipelines.lm.prompts import RunPrompts
from dovetail.rewards.text import answers_match
from dovetail.run_dir import check_same_model
from dovetail.sched import policy_class

STEPS = 2
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHARS = "0123456789+-*=?: abcdefghijklmnopqrstuvwxyz<>/.,"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REWARDS = '''
def correct(completions, prompts, answer, **columns):
    """A user's reward of the `answer` column: 1 where the completion starts with it, 0.1 where it holds it."""
    return [float(c.strip().startswith(a)) + 0.1 * float(a in c) for c, a in zip(completions, answer)]
'''


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, <s> first, and a chat template over <|user|> / <|assistant|> turns."""
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*SPECIAL, *CHARS])}, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def tiny_model(architecture: str, seed: int = 0, head_dim: int = 8):
    """A random-init model of 2 layers, GQA (4 query heads of `head_dim`, 2 kv heads), every weight drawn from `seed`
    (norms around 1, biases too), so that a bias or norm the engine missed shows."""
    tokenizer = char_tokenizer()
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    width = 4 * head_dim
    if architecture == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=len(tokenizer), n_embd=width, n_layer=2, n_head=4, n_positions=96)
        )
    else:
        config_class, model_class, changes = ARCHITECTURES[architecture]
        config = config_class(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=96,
            tie_word_embeddings=False,
            **ids,
            **changes,
        )
        model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * 0.2
            parameter.copy_(1 + noise if "norm" in name or name.endswith("ln_f.weight") else noise)
    return model.float().eval(), tokenizer


def save_tiny_model(directory: Path, architecture: str) -> Path:
    model, tokenizer = tiny_model(architecture)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sums(first: int, count: int) -> list[dict]:
    return [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "source": "sums"}
        for a in range(first, first + count)
        for b in range(10)
    ]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """What a user has: two model directories (and an encoder, no causal LM), a dataset (text prompts; the same as
    chat messages), a held-out file, a reward module and a config beside it."""
    root = tmp_path_factory.mktemp("workspace")
    save_tiny_model(root / "my-llama", "llama")
    save_tiny_model(root / "my-qwen2", "qwen2")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums(0, 8)))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums(8, 2)))
    chat = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in sums(0, 8)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (root / "myrewards.py").write_text(REWARDS)
    T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2)).save_pretrained(
        root / "encoder"
    )
    char_tokenizer().save_pretrained(root / "encoder")
    config = {
        "kind": "lm",
        "model": {"path": str(root / "my-llama")},
        "prompts": {"path": str(root / "train.jsonl"), "eval_path": str(root / "test.jsonl")},
        "reward": {"myrewards:correct": 1.0, "answer_match": 1.0, "length_penalty": 0.5},
        "sampling": {"max_new_tokens": 8, "stop": ["."]},
        "algo": {"prompts_per_step": 4, "group_size": 4},
        "eval": {"prompts": 4, "every": 100},
        "train": {"lr": 3e-3},
        "checkpoint": {"every": 100},
        "runtime": {"profile_samples": 4},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    return root


def user_config(workspace: Path, *overrides: str):
    """The config as `dovetail train WORKSPACE/run.yaml` reads it, from any working directory: the reward module
    beside it imports."""
    return load_config(workspace / "run.yaml", list(overrides))


def lora_qwen(workspace: Path) -> list[str]:
    """The Qwen2 model with a LoRA adapter, on the dataset's prompts as chat messages, a fifth held out."""
    return [
        f"model.path={workspace / 'my-qwen2'}",
        f"prompts.path={workspace / 'chat.jsonl'}",
        "prompts.prompt_field=messages",
        "prompts.eval_path=null",
        "prompts.eval_fraction=0.2",
        "model.lora.rank=4",
        "model.lora.alpha=8.0",
    ]


def trained(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory):
    """The reference loop's runs: the Llama whole, the Qwen2's LoRA adapter on chat prompts."""
    out = tmp_path_factory.mktemp("runs")
    train(user_config(workspace, "policy=reference"), out / "llama", steps=STEPS)
    train(user_config(workspace, "policy=reference", *lora_qwen(workspace)), out / "qwen2-lora", steps=STEPS)
    return out


# ---------------------------------------------------------------- the engine against the trainer


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, "gpt2"])
def test_the_rollout_engine_samples_what_the_trainer_computes_for_each_architecture(architecture, tmp_path):
    """Llama, Qwen2 (q / k / v biases), Qwen3 (per-head q / k norms) and Mistral run on our engine, GPT-2 on
    transformers' own forward; either way the log-prob of every sampled token is the trainer's."""
    directory = save_tiny_model(tmp_path / architecture, architecture)
    model = load_causal_lm(directory, lora=None, seed=0)
    engine = rollout_engine(
        model, SamplingParams(max_new_tokens=12, stop_ids=(2,), seed=5), max_len=96, device=torch.device("cpu")
    )
    assert isinstance(engine, TransformersEngine if architecture == "gpt2" else TorchEngine)
    tokenizer = HFTokenizer.load(directory)
    prompts = [tokenizer.prompt_ids(p) for p in ("1+2=", "33+4=", "1+2=", "9=")]
    results = engine.generate([Request((0, i, 0), p) for i, p in enumerate(prompts)])
    assert results[0].tokens != results[2].tokens  # same prompt, another sample key: another draw
    with torch.no_grad():
        log_probs, mask = response_log_probs(model, prompts, [r.tokens for r in results], 1.0)
    for row, result in enumerate(results):
        torch.testing.assert_close(log_probs[row][mask[row]], torch.tensor(result.log_probs), atol=1e-5, rtol=0)
    # paused at 3 tokens and continued on a fresh engine: the same tokens
    first = rollout_engine(model, engine.params, max_len=96, device=torch.device("cpu"))
    second = rollout_engine(model, engine.params, max_len=96, device=torch.device("cpu"))
    paused = first.generate([Request((0, i, 0), p) for i, p in enumerate(prompts)], until=3)
    assert [r.tokens for r in second.generate(paused)] == [r.tokens for r in results]


def test_sampling_engine_auto_is_vllm_on_gpus_where_vllm_is_installed_and_ours_elsewhere(monkeypatch):
    """The default engine is what a user of verl or TRL generates with on GPUs (vLLM), where it can run, and ours on
    CPU cores (bitwise the trainer's); a chosen engine is kept; vLLM brings the old log-prob pass into the plan."""
    import dovetail.pipelines.lm.config as lm_config

    def config(*overrides: str):
        return load_config(Path(__file__).parents[1] / "configs/sort.yaml", list(overrides))

    assert config().sampling.engine == "auto"
    monkeypatch.setattr(lm_config, "find_spec", lambda name: None)
    assert config("cluster.device=H100").rollout_engine == "dovetail"  # a GPU without vLLM
    monkeypatch.setattr(lm_config, "find_spec", lambda name: object() if name == "vllm" else None)
    assert config("cluster.device=H100").rollout_engine == "vllm"
    assert config().rollout_engine == "dovetail"  # CPU cores, vLLM or not
    assert config("cluster.device=H100", "sampling.engine=dovetail").rollout_engine == "dovetail"
    assert config("cluster.device=H100").scenario(2).pipelines[0].recompute_logprob
    assert not config("cluster.device=H100", "sampling.engine=dovetail").scenario(2).pipelines[0].recompute_logprob


def test_sampling_engine_hf_runs_transformers_forward_for_an_architecture_ours_computes(workspace):
    """`sampling.engine: hf` (`ROLLOUT_ENGINES`) takes transformers' forward even for a Llama, with the trainer's
    log-probs and our engine's keyed tokens."""
    model = load_causal_lm(workspace / "my-llama", lora=None, seed=0)
    params = SamplingParams(max_new_tokens=12, stop_ids=(2,), seed=5)
    prompts = [HFTokenizer.load(workspace / "my-llama").prompt_ids(p) for p in ("1+2=", "33+4=")]
    requests = [Request((0, i, 0), p) for i, p in enumerate(prompts)]
    engines = {
        name: rollout_engine(model, params, max_len=96, device=torch.device("cpu"), engine=name)
        for name in ("hf", "dovetail")
    }
    assert isinstance(engines["hf"], TransformersEngine) and isinstance(engines["dovetail"], TorchEngine)
    hf, ours = (engines[name].generate(requests) for name in ("hf", "dovetail"))
    assert [r.tokens for r in hf] == [r.tokens for r in ours]
    with torch.no_grad():
        log_probs, mask = response_log_probs(model, prompts, [r.tokens for r in hf], 1.0)
    for row, result in enumerate(hf):
        torch.testing.assert_close(log_probs[row][mask[row]], torch.tensor(result.log_probs), atol=1e-5, rtol=0)


def test_stop_strings_end_a_response_at_the_token_that_completes_one(workspace):
    tokenizer = HFTokenizer.load(workspace / "my-llama")
    model = load_causal_lm(workspace / "my-llama", lora=None, seed=0)
    prompt = tokenizer.prompt_ids("3+4=")
    for seed in range(100):  # a seed whose response runs a while
        params = SamplingParams(max_new_tokens=20, stop_ids=tokenizer.stop_ids, seed=seed)
        free = rollout_engine(model, params, max_len=96, device=torch.device("cpu")).generate(
            [Request((0, 0, 0), prompt)]
        )
        text = tokenizer.decode(free[0].tokens)
        if len(text) >= 8:
            break
    stop = text[4:6]  # a stop string the free response holds
    stops = StopStrings(tokenizer, [stop])
    stopped = rollout_engine(model, params, max_len=96, device=torch.device("cpu"), stop=stops).generate(
        [Request((0, 0, 0), prompt)]
    )[0]
    assert stopped.finished and stopped.tokens == free[0].tokens[: len(stopped.tokens)]
    assert tokenizer.decode(stopped.tokens).endswith(stop) and stop not in tokenizer.decode(stopped.tokens[:-1])


# ---------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.exactness
def test_a_user_model_trains_under_reference_and_verl_sync_to_the_same_bits(runs, workspace, local_ray, tmp_path):
    start = load_file(workspace / "my-llama" / "model.safetensors")
    reference = trained(runs / "llama")
    assert max((reference[k] - start[k]).abs().max().item() for k in start) > 1e-4  # it trained every weight
    train(user_config(workspace, "policy=verl-sync"), tmp_path, steps=STEPS)
    assert same_bits(trained(tmp_path), reference)
    ours, theirs = metrics(tmp_path), metrics(runs / "llama")
    assert [m["reward/total"] for m in ours] == [m["reward/total"] for m in theirs]
    assert {"reward/myrewards:correct", "reward/answer_match", "reward/length_penalty"} <= ours[0].keys()
    assert all(m["entropy"] > 0.5 for m in ours)  # the sampling distributions' real entropy, not 0
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []


@pytest.mark.slow
@pytest.mark.exactness
def test_lora_trains_publishes_and_checkpoints_the_adapter_alone_under_both_policies(
    runs, workspace, local_ray, tmp_path
):
    adapter = trained(runs / "qwen2-lora")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert max(v.abs().max().item() for k, v in adapter.items() if ".lora_B." in k) > 1e-5  # B starts at 0: it trained
    optimizer = torch.load(runs / "qwen2-lora" / "checkpoints" / f"step_{STEPS:06d}" / "optimizer.pt")
    assert len(optimizer["state"]) == len(adapter)  # Adam's moments of the adapter alone
    train(user_config(workspace, "policy=verl-sync", *lora_qwen(workspace)), tmp_path, steps=STEPS)
    assert same_bits(trained(tmp_path), adapter)
    published = {m["publish_bytes"] for m in metrics(tmp_path)}
    assert published == {sum(v.nbytes for v in adapter.values())}


def test_a_lora_policys_critic_is_a_whole_model_on_the_adapters_base_weights(workspace):
    """verl's critic takes no adapter of the actor's: a LoRA run's critic body is the base model's every weight (the
    adapter's frozen base, to the bit) and every one of them trains, its head fresh."""
    config = user_config(workspace, *lora_qwen(workspace))
    policy = load_causal_lm(config.model.path, lora=config.model.lora.model_dump(), seed=config.seed)
    critic = value_model_of(policy, config.seed)
    base = load_file(workspace / "my-qwen2" / "model.safetensors")
    body = {f"model.{k}": v for k, v in critic.body.state_dict().items()}
    assert {k for k in base if k != "lm_head.weight"} <= body.keys()
    assert all(torch.equal(body[k], base[k]) for k in base if k in body)
    assert all(p.requires_grad for p in critic.parameters()) and not any(".lora_" in k for k in body)


@pytest.mark.slow
@pytest.mark.exactness
def test_ppo_with_a_lora_policy_trains_adapter_and_critic_under_verl_sync_as_the_reference(
    workspace, local_ray, tmp_path
):
    """algo.advantage: gae beside a LoRA adapter: verl-sync ends at the reference loop's adapter and critic to the
    bit, the critic moved."""
    ppo = ["algo.advantage=gae", "algo.lam=0.95", "critic.lr=1e-3", "algo.micro_batches=1"]
    for policy in ("reference", "verl-sync"):
        train(user_config(workspace, f"policy={policy}", *lora_qwen(workspace), *ppo), tmp_path / policy, steps=STEPS)
    for name in ("model.safetensors", "critic.safetensors"):
        ends = [
            load_file(tmp_path / p / "checkpoints" / f"step_{STEPS:06d}" / name) for p in ("reference", "verl-sync")
        ]
        assert same_bits(*ends), name
    critic = load_file(tmp_path / "reference" / "checkpoints" / f"step_{STEPS:06d}" / "critic.safetensors")
    base = load_file(workspace / "my-qwen2" / "model.safetensors")
    moved = [
        (critic[f"body.{k.removeprefix('model.')}"] - v).abs().max().item() for k, v in base.items() if "layers" in k
    ]
    assert max(moved) > 1e-5, "the critic's body trained"


CRITIC_LORA = ["algo.advantage=gae", "algo.lam=0.95", "critic.lr=1e-3", "algo.micro_batches=1", "critic.lora.rank=4"]
"""PPO whose critic trains an adapter of its own (verl's critic lora_rank), beside the policy's."""


@pytest.mark.slow
@pytest.mark.exactness
def test_a_lora_critic_trains_its_adapter_and_head_alone_under_verl_sync_as_the_reference(
    workspace, local_ray, tmp_path
):
    """critic.lora: the critic's body is frozen under an adapter of its own, seeded apart from the policy's; its
    adapter and value head train. verl-sync ends at the reference loop's policy adapter and critic to the bit; the
    critic's base weights are where they started to the bit, its adapter's B and its head moved."""
    config = user_config(workspace, *lora_qwen(workspace), *CRITIC_LORA)
    policy = load_causal_lm(config.model.path, lora=config.model.lora.model_dump(), seed=config.seed)
    start = value_model_of(policy, config.seed, config.critic.lora.model_dump())
    trains = {name for name, p in start.named_parameters() if p.requires_grad}
    assert trains and all(".lora_" in name or name.startswith("head.") for name in trains)
    for run in ("reference", "verl-sync"):
        overrides = [f"policy={run}", *lora_qwen(workspace), *CRITIC_LORA]
        train(user_config(workspace, *overrides), tmp_path / run, steps=STEPS)

    def saved(run: str, name: str) -> dict:
        return load_file(tmp_path / run / "checkpoints" / f"step_{STEPS:06d}" / name)

    for name in ("model.safetensors", "critic.safetensors"):
        assert same_bits(saved("reference", name), saved("verl-sync", name)), name
    ended, began = saved("reference", "critic.safetensors"), start.state_dict()
    assert ended.keys() == began.keys()
    frozen = [k for k in began if ".lora_" not in k and not k.startswith("head.")]
    assert frozen and all(torch.equal(ended[k], began[k]) for k in frozen)
    for moved in ([k for k in began if ".lora_B." in k], ["head.weight"]):
        assert max((ended[k] - began[k]).abs().max().item() for k in moved) > 1e-5, moved


def test_a_critic_adapter_the_run_cannot_train_is_one_line_naming_the_fix(workspace):
    ppo = ["algo.advantage=gae", "critic.lr=1e-4", "critic.lora.rank=4"]
    refusals = [
        ([], "critic.lora: LoRA trains your own model's critic; give its directory as model.path"),
        (
            [f"model.path={workspace / 'my-qwen2'}", "policy=verl-sync", "train.sharding=fsdp"],
            "train.sharding=fsdp: a LoRA adapter trains replicated (its frozen base is 4 bytes a parameter); drop "
            "critic.lora",
        ),
    ]
    for overrides, said in refusals:
        with pytest.raises(ConfigError) as refused:
            load_config(None, ["kind=lm", *ppo, *overrides])
        assert said in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["streamrl", "areal"])
def test_an_asynchronous_policy_trains_a_user_lora_adapter_with_bounded_staleness(
    policy, workspace, local_ray, tmp_path
):
    """streamrl / areal decode the next batch on the previous adapter: the rollout engines merge the published
    adapter into the base, stale samples get the decoupled correction from the engine's log-probs (areal's proximal
    log-probs recomputed by the trainer), within the policy's staleness bound."""
    summary = train(user_config(workspace, f"policy={policy}", *lora_qwen(workspace)), tmp_path, steps=3)
    lines = metrics(tmp_path)
    assert 1 <= max(m["staleness"] for m in lines) == summary["max_staleness"] <= policy_class(policy).max_staleness
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []
    assert {m["publish_bytes"] for m in lines} == {sum(v.nbytes for v in trained(tmp_path, step=3).values())}


@pytest.mark.slow
def test_a_users_two_models_multiplexed_end_where_each_ends_alone(runs, workspace, local_ray, tmp_path):
    """A multiplexed run of a user's models (the Llama whole, the Qwen2's LoRA adapter on chat prompts, each entry a
    whole run config as run.yaml reads) on the shared pool (jigsaw's `arrangement`, which its own choice could make a
    split or back-to-back run, by costs measured under the suite's load), and each pipeline ends at its reference
    loop's bits."""
    llama = yaml.safe_load((workspace / "run.yaml").read_text())
    qwen = json.loads(json.dumps(llama))  # its own copy: YAML would write the shared sections as aliases
    qwen |= {"model": {"path": str(workspace / "my-qwen2"), "lora": {"rank": 4, "alpha": 8.0}}}
    qwen |= {"prompts": {"path": str(workspace / "chat.jsonl"), "prompt_field": "messages", "eval_fraction": 0.2}}
    both = {"kind": "multiplex", "policy": "jigsaw", "arrangement": "shared", "cluster": {"devices": 2}}
    both |= {"pipelines": [llama, qwen]}
    (workspace / "both.yaml").write_text(yaml.safe_dump(both))
    summary = train(load_config(workspace / "both.yaml"), tmp_path, steps=STEPS)
    assert set(summary["pipelines"]) == {"my-llama", "my-qwen2"}
    assert same_bits(trained(tmp_path / "my-llama"), trained(runs / "llama"))
    assert same_bits(trained(tmp_path / "my-qwen2"), trained(runs / "qwen2-lora"))
    spans = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    devices = [{e["tid"] for e in spans if e["name"].startswith(f"{name}:")} for name in ("my-llama", "my-qwen2")]
    assert devices[0] & devices[1], "the pipelines share the pool's devices"


def test_the_entropy_bonus_trains_and_the_entropy_is_measured(runs, workspace, tmp_path):
    train(user_config(workspace, "policy=reference", "algo.entropy_coef=1.0"), tmp_path, steps=STEPS)
    first, plain = metrics(tmp_path)[0], metrics(runs / "llama")[0]
    assert first["entropy"] == plain["entropy"] > 0.5  # step 1 samples the same responses from the same weights
    assert not same_bits(trained(tmp_path), trained(runs / "llama"))


def test_an_architecture_our_engine_does_not_compute_trains_on_transformers_forward_with_a_note(
    workspace, tmp_path, capsys
):
    model = save_tiny_model(tmp_path / "my-gpt2", "gpt2")
    config = user_config(workspace, f"model.path={model}", "policy=reference")
    train(config, tmp_path / "run", steps=1)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: {model}: our rollout engine does not compute architecture 'gpt2' (the engine computes llama, mistral, "
        "qwen2, qwen3); rollouts run on transformers' own forward (slower)"
    ]
    assert metrics(tmp_path / "run")[0]["response_tokens"] > 0


# ---------------------------------------------------------------- export


def test_a_user_runs_config_yaml_records_no_task_and_an_older_one_that_did_still_resumes(runs, workspace, tmp_path):
    """A model.path run trains the dataset, not the default task (`sort`), so its config.yaml names no task; one an
    older version wrote with `task: sort` is still the same model's run for --resume."""
    recorded = yaml.safe_load((runs / "llama" / "config.yaml").read_text())
    assert "task" not in recorded and recorded["model"]["path"] == str(workspace / "my-llama")
    assert load_config(runs / "llama" / "config.yaml").model_dump(mode="json") == recorded
    built_in = load_config(None, ["kind=lm", "task=countdown"]).model_dump(mode="json")
    assert built_in["task"] == "countdown"  # a task run records its task
    older = tmp_path / "older"
    older.mkdir()
    (older / "config.yaml").write_text(yaml.safe_dump(recorded | {"task": "sort"}))
    check_same_model(older, user_config(workspace).model_dump(mode="json"))


def test_export_writes_a_transformers_directory_that_loads_and_generates(runs, workspace, tmp_path):
    runner = CliRunner()
    out = tmp_path / "llama"
    result = runner.invoke(app, ["export", str(runs / "llama"), str(out)])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(out)
    assert same_bits(
        {k: v for k, v in model.state_dict().items() if k in trained(runs / "llama")}, trained(runs / "llama")
    )
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("3+4=", return_tensors="pt").input_ids
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1]

    lora_out = tmp_path / "qwen2-lora"
    assert runner.invoke(app, ["export", str(runs / "qwen2-lora"), "--step", str(STEPS), str(lora_out)]).exit_code == 0
    merged = AutoModelForCausalLM.from_pretrained(lora_out)
    base = load_file(workspace / "my-qwen2" / "model.safetensors")
    adapter = trained(runs / "qwen2-lora")
    expected = dict(base)
    for name in {k.split(".lora_A.")[0] for k in adapter if ".lora_A." in k}:
        layer = name.removeprefix("base_model.model.")
        expected[f"{layer}.weight"] = (
            base[f"{layer}.weight"] + 2.0 * adapter[f"{name}.lora_B.weight"] @ adapter[f"{name}.lora_A.weight"]
        )
    state = merged.state_dict()
    assert max((state[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(workspace / "my-qwen2"), lora_out / "lora"
    )
    assert same_bits(get_peft_model_state_dict(reloaded), adapter)
    chat = AutoTokenizer.from_pretrained(lora_out).apply_chat_template(
        [{"role": "user", "content": "3+4="}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert merged.generate(**chat, max_new_tokens=3, do_sample=False).shape[1] > chat["input_ids"].shape[1]


def test_a_built_in_task_model_exports_with_its_tokenizer(tmp_path):
    small = ["kind=lm", "algo.prompts_per_step=2", "algo.group_size=2", "eval.prompts=2", "policy=reference"]
    train(load_config(None, small), tmp_path / "run", steps=1)
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    checkpoint = trained(tmp_path / "run", 1)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in checkpoint.items())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = load_tokenizer(load_config(None, small).model.checkpoint)
    assert tokenizer("sort 3 1:").input_ids == ours.prompt_ids("sort 3 1:")
    ids = torch.tensor([ours.prompt_ids("sort 3 1:")])
    completion = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(completion[0, ids.shape[1] :], skip_special_tokens=True)


# ---------------------------------------------------------------- prompts, rewards, the planner


def test_prompts_chat_templates_truncation_and_the_step_draw(workspace):
    config = user_config(workspace, *lora_qwen(workspace), "prompts.max_tokens=4")
    prompts = RunPrompts(config)
    tokenizer = HFTokenizer.load(workspace / "my-qwen2")
    row = prompts.train(0, 0)
    assert isinstance(row.prompt, list) and row.columns == {"answer": row.columns["answer"]}
    templated = tokenizer.tokenizer.apply_chat_template(row.prompt, add_generation_prompt=True, tokenize=False)
    assert templated.startswith("<|user|>") and templated.endswith("<|assistant|>")
    (ids,) = encode_prompts(config, tokenizer, [row], 96)
    full = tokenizer.prompt_ids(row.prompt)
    assert len(full) > 4 and ids == full[-4:]  # left truncation keeps the end of the prompt
    # every train row once per epoch, in an order of (seed, epoch) alone
    rows = len(prompts.dataset.train)
    epoch = [json.dumps(prompts.train(s, p).prompt) for s in range(rows // 4) for p in range(4)]
    assert sorted(epoch) == sorted(json.dumps(r.prompt) for r in prompts.dataset.train)
    assert [prompts.train(3, p) for p in range(4)] == RunPrompts(config).step(3)
    split = RunPrompts(user_config(workspace, "prompts.eval_path=null", "prompts.eval_fraction=0.25")).dataset
    assert split is not None
    assert not {r.prompt for r in split.train} & {r.prompt for r in split.eval} and len(split.eval) > 5


@pytest.mark.parametrize(
    "completion, answer, match",
    [
        ("so the sum is \\boxed{\\frac{1}{2}}", "0.5", True),
        ("The answer is 1,000.", "#### 1000", True),
        ("<think>7</think><answer> Paris </answer>", "paris", True),
        ("it is 12 or 13", "13", True),
        ("it is 13 or 12", "13", False),
        ("\\boxed{x+1}", "x + 1", False),
        ("\\boxed{x + 1}", "X + 1", True),
    ],
)
def test_answer_match_reads_answers_as_the_math_graders_do(completion, answer, match):
    assert answers_match(completion, answer) is match


def test_the_planner_prices_a_user_model_from_its_config(workspace):
    config = user_config(workspace, "policy=verl-sync")
    model, _ = tiny_model("llama")
    spec = config.scenario(3).pipelines[0]
    priced = spec.catalogue_model()
    assert (spec.model, priced.params) == ("my-llama", sum(p.numel() for p in model.parameters()))
    assert (priced.layers, priced.hidden, priced.kv_heads, priced.head_dim) == (2, 32, 2, 8)
    lora = user_config(workspace, "policy=verl-sync", *lora_qwen(workspace)).scenario(3).pipelines[0]
    assert (lora.lora.rank, lora.lora.targets) == (4, "all-linear")
    named = user_config(workspace, "policy=verl-sync", "model.cost_model=Qwen3-8B").scenario(3).pipelines[0]
    assert named.catalogue_model().name == "Qwen3-8B"


def test_a_user_models_scenario_takes_the_lengths_its_profile_decoded(workspace):
    """Before it decodes, a user's model is priced at responses of half the budget; its start-up profile measures
    the prompts' and the base model's responses' token counts, and the planner then prices those (the dry run, the
    run's plan and `policy=auto` alike). A task run's lengths are its task's."""
    config = user_config(workspace, "policy=verl-sync")
    guessed = config.scenario(3).pipelines[0]
    assert guessed.lengths.kind == "lognormal" and guessed.lengths.median == config.max_new_tokens // 2
    refined = config.profiled({"prompt_tokens": [5, 6, 6, 7], "lengths": [2, 0, 3, 8]}).scenario(3).pipelines[0]
    assert refined.prompt_length == 6
    assert (refined.lengths.kind, refined.lengths.values) == ("empirical", [2, 1, 3, 8])  # at least one token
    assert config.scenario(3).pipelines[0] == guessed  # the config it came from is unchanged
    task_run = load_config(None, ["kind=lm", "policy=verl-sync"])
    assert task_run.profiled({"prompt_tokens": [1], "lengths": [1]}).scenario(3) == task_run.scenario(3)


# ---------------------------------------------------------------- what will not do


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["model.path=nowhere"], "model.path: no directory nowhere, nor a hub model id the cache"),
        (["model.path=."], "has no config.json with a model_type: not a transformers model directory"),
        (["model.path=encoder"], "a 't5' model is no causal language model transformers knows"),
        (
            ["model.checkpoint=my-llama", "model.path=null", "prompts=null", "reward=null", "sampling.stop=[]"],
            "my-llama is a transformers model directory: give it as model.path",
        ),
        (["prompts.path=missing.jsonl"], "prompts.path: no dataset file"),
        (
            ["prompts.prompt_field=question"],
            "record 1 has no text or a list of chat messages with role and content in 'question'; set prompts.prompt",
        ),
        (["prompts=null"], "a model.path run trains on your dataset; give it as prompts.path"),
        (["model.path=null"], "the built-in task models read only their task's prompts"),
        (["reward=null"], "a prompts.path run names its rewards"),
        (["reward={exact_answer: 1.0}"], "unknown text reward 'exact_answer'"),
        (["reward={myrewards:nothing: 1.0}"], "reward 'myrewards:nothing' cannot be imported"),
        (["sampling.max_new_tokens=95"], "exceed the model's context of 96 tokens"),
        (["prompts.prompt_field=answer"], "reward 'answer_match' reads the column answer, which"),
        (["prompts.eval_path=null", "prompts.eval_fraction=0.001"], "leave no eval prompt"),
    ],
)
def test_bad_inputs_are_one_line_naming_the_field_and_the_fix(overrides, says, workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    result = CliRunner().invoke(app, ["train", "run.yaml", *overrides, "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert says in result.output, result.output
