"""A user's own transformers causal language model (`model.path`), behind what the LM engines use of the built-in one.

`model.path` names a directory in `save_pretrained` layout: config.json, the weights, and the tokenizer's files. The
model trains in fp32 with eager attention (plain matmuls and softmax: the same arithmetic on every backend, so the
reference loop and every policy compute the same bits), whole or as a peft LoRA adapter whose initial A matrices
come from the run's seed. Rollouts run on the engine `sampling.engine` names (`ROLLOUT_ENGINES`): by default our
`TorchEngine` where `LlamaWeights` computes the architecture (Llama, Mistral, Qwen2, Qwen3), else transformers' own
forward (`TransformersEngine`, also `hf`), or vLLM (`vllm`); any of them is given full weights under transformers'
names, a LoRA adapter merged in (`CausalLM.rollout_state_dict`).

What the engines see of the model, as of the built-in `LlamaForCausalLM`: `config`, `forward(input_ids,
attention_mask).logits`, and `trained_state_dict` / `load_trained_state_dict`: what weight publication, trainer
hand-over and checkpoints carry (a LoRA run's adapter alone). The tokenizer (`HFTokenizer`) has the built-in
`CharTokenizer`'s `prompt_ids`, `decode` and `stop_ids`.
"""

import json
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from dovetail.files import one_line
from dovetail.models.engine import Engine, SamplingParams, TorchEngine, TransformersEngine, engine_problem
from dovetail.models.memory import counted_on_meta
from dovetail.models.tokenizer import CharTokenizer
from dovetail.models.training import has_lora, load_lora_state_dict, lora_state_dict, with_lora

ADAPTER_DIR = "lora"
"""Where `export` writes a LoRA run's adapter in peft's layout, inside the exported model directory."""


class HFTokenizer:
    """A transformers tokenizer as an LM run reads it: a prompt's ids (text with the tokenizer's own special tokens,
    chat messages through its chat template with the generation prompt), a response's text (special tokens
    skipped), and the ids that end a response (the tokenizer's and the generation config's end of sequence)."""

    def __init__(self, tokenizer, stop_ids: tuple[int, ...], directory: Path):
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.directory = directory

    @classmethod
    def load(cls, directory: Path | str) -> "HFTokenizer":
        directory = Path(directory)
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory)
        except Exception as error:  # a missing or damaged tokenizer raises whatever its loader does
            raise ValueError(f"model.path {directory}: no tokenizer loads from it ({one_line(error)[:200]})") from None
        stops = {tokenizer.eos_token_id}
        if (directory / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(directory).eos_token_id
            stops |= set(eos) if isinstance(eos, list) else {eos}
        return cls(tokenizer, tuple(sorted(i for i in stops if i is not None)), directory)

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if not self.tokenizer.chat_template:
            raise ValueError(
                f"a prompt of chat messages needs a chat template, and the tokenizer of {self.directory} has none: "
                "give prompts as text, or a tokenizer with a chat_template"
            )
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote its own

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class StopStrings:
    """`sampling.stop` (and an env run's call ends): a response, or a multi-turn rollout's turn, ends at the token that
    completes one of these strings (the token kept, its text in the completion). Reads the response's (the turn's) own
    tokens only, the last few decoded: a stop string of n characters spans at most n tokens of a character or more
    each, and the check runs after every token."""

    def __init__(self, tokenizer: HFTokenizer | CharTokenizer, stops: list[str]):
        self.decode = tokenizer.decode
        self.stops = stops
        self.window = max(map(len, stops)) + 8  # tokens that decode to nothing (special ones) widen what a stop spans

    def __call__(self, tokens: list[int]) -> bool:
        tail = self.decode(tokens[-self.window :])
        return any(stop in tail for stop in self.stops)


class CausalLM(torch.nn.Module):
    """A transformers causal LM, `model` itself or a peft LoRA adapter on it (then only the adapter trains)."""

    def __init__(self, model, source: dict):
        super().__init__()
        self.model = model
        self.source = source
        """How to build this model again: the directory and the LoRA settings (a checkpoint's config)."""
        self._base_weights: dict[str, torch.Tensor] = {}
        if self.lora:
            base = model.get_base_model().state_dict()
            self._base_weights = {k.replace(".base_layer.", "."): v for k, v in base.items() if ".lora_" not in k}
            peft = model.peft_config["default"]
            self._scaling = peft.lora_alpha / peft.r
            self._fan_in_fan_out = peft.fan_in_fan_out

    @property
    def lora(self) -> bool:
        return has_lora(self.model)

    @property
    def base_weights(self) -> dict[str, torch.Tensor]:
        """A LoRA model's frozen base, under transformers' names (the weights the adapter is added to)."""
        return self._base_weights

    @property
    def config(self):
        return (self.model.get_base_model() if self.lora else self.model).config

    def forward(self, **inputs):
        return self.model(**inputs)

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """What trains: the LoRA adapter's tensors, or the whole model's (under transformers' names)."""
        return lora_state_dict(self.model) if self.lora else self.model.state_dict()

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not self.lora:
            self.model.load_state_dict(state)
            return
        load_lora_state_dict(self.model, state)

    def rollout_state_dict(self, trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full weights under transformers' names of trained tensors `trained_state_dict` gave (another
        version's, published): themselves, or the frozen base with the adapter merged in, W + alpha / r * B A."""
        if not self.lora:
            return trained
        merged = dict(self._base_weights)
        for name, lora_a in trained.items():
            if not name.endswith(".lora_A.weight"):
                continue
            module = name.removesuffix(".lora_A.weight")
            weight = f"{module.removeprefix('base_model.model.')}.weight"
            base = merged[weight]  # on the host: the base as loaded, kept when the model moves to a GPU
            delta = trained[f"{module}.lora_B.weight"].to(base.device) @ lora_a.to(base.device)
            merged[weight] = base + self._scaling * (delta.T if self._fan_in_fan_out else delta)
        return merged


def load_causal_lm(path: Path | str, *, lora: dict | None, seed: int) -> CausalLM:
    """The model of a transformers directory (`config.lm.LMModelSection` has checked its layout) in fp32 with eager
    attention, in eval mode; with `lora`, a peft adapter seeded by `seed` on its linear layers."""
    path = Path(path).resolve()
    transformers.utils.logging.disable_progress_bar()  # the run's own display says what start-up is doing
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    except Exception as error:  # an unknown architecture, damaged weights: whatever the loader raises
        raise ValueError(f"model.path {path}: no causal LM loads from it ({one_line(error)[:300]})") from None
    if lora is not None:
        model = with_lora(model, lora, seed, task_type="CAUSAL_LM")
        if any(".lora_embedding_" in name for name in lora_state_dict(model)):
            raise ValueError(
                f"model.lora.target_modules={lora['target_modules']} adapts an embedding: LoRA trains linear layers "
                "here (all-linear, or their names)"
            )
    return CausalLM(model, {"transformers_path": str(path), "lora": lora}).eval()


def causal_lm_parameter_counts(path: Path | str, *, lora: dict | None, seed: int) -> tuple[int, int]:
    """(parameters, trained parameters) of a transformers directory's model with `lora`, from its config alone."""
    config = causal_lm_config(path)

    def build():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return with_lora(model, lora, seed, task_type="CAUSAL_LM") if lora is not None else model

    return counted_on_meta(build)


def causal_lm_config(path: Path | str):
    """The transformers config of a directory's model, read without its weights (a dry run plans a GPU cluster from
    a laptop); one that is no causal LM transformers knows is one line naming it."""
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:  # an unknown model_type, a damaged file: whatever the loader raises
        raise ValueError(f"model.path {path}: its config.json does not load ({one_line(error)[:300]})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"model.path {path}: a {config.model_type!r} model is no causal language model transformers knows "
            "(AutoModelForCausalLM loads none)"
        )
    return config


def context_of(path: Path | str) -> int:
    """The positions a model of this directory reads (its config's max_position_embeddings), without its weights."""
    return causal_lm_config(path).max_position_embeddings


def _ours(model, params: SamplingParams, *, max_len: int, device: torch.device, stop, max_batch: int) -> Engine:
    """`sampling.engine: dovetail`: our `TorchEngine` where it computes the architecture, else transformers' forward."""
    if engine_problem(model.config, max_len) is None:
        return TorchEngine(model.config, params, max_batch=max_batch, max_len=max_len, device=device, stop=stop)
    return _transformers(model, params, max_len=max_len, device=device, stop=stop, max_batch=max_batch)


def _transformers(model, params: SamplingParams, *, max_len: int, device: torch.device, stop, max_batch: int) -> Engine:
    """`sampling.engine: hf`: transformers' own forward and KV cache (what its `generate` runs) on a fresh copy."""
    config = model.config
    copy = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").to(device)
    return TransformersEngine(copy, params, max_len=max_len, max_batch=max_batch, stop=stop)


def _vllm(model, params: SamplingParams, *, max_len: int, device: torch.device, stop, max_batch: int) -> Engine:
    """`sampling.engine: vllm`: vLLM's offline engine, imported here only (the project's environment has no vLLM)."""
    from dovetail.models.vllm_engine import VllmEngine

    return VllmEngine(model.config, params, max_len=max_len, max_batch=max_batch, device=device, stop=stop)


ROLLOUT_ENGINES = {"dovetail": _ours, "hf": _transformers, "vllm": _vllm}
"""Each `sampling.engine`'s builder: the one place that decides which `Engine` generates an LM pipeline's rollouts."""


def rollout_engine(
    model,
    params: SamplingParams,
    *,
    max_len: int,
    device: torch.device,
    stop=None,
    max_batch: int = 64,
    engine: str = "dovetail",
) -> Engine:
    """The rollout engine (`ROLLOUT_ENGINES[engine]`) of a transformers model (the built-in `LlamaForCausalLM` or a
    `CausalLM`), its weights loaded."""
    built = ROLLOUT_ENGINES[engine](model, params, max_len=max_len, device=device, stop=stop, max_batch=max_batch)
    built.load_weights(rollout_state(model, model.trained_state_dict() if isinstance(model, CausalLM) else None))
    return built


def rollout_state(model, trained: dict | None) -> dict:
    """What a rollout engine loads of trained tensors (None: the model's own): a `CausalLM`'s full weights, the
    built-in model's state."""
    if isinstance(model, CausalLM):
        return model.rollout_state_dict(trained if trained is not None else model.trained_state_dict())
    return trained if trained is not None else model.state_dict()


# ---------------------------------------------------------------- what a run saves and exports


def save_causal_lm_checkpoint(model: CausalLM, directory: Path) -> None:
    """A checkpoint's model files: model.safetensors the trained tensors (a LoRA run's adapter alone; tied weights
    stored under each name), config.json how to build the model they fit (the directory, the LoRA settings)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.trained_state_dict().items()}
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(model.source, indent=2))


def load_causal_lm_checkpoint(directory: Path | str) -> CausalLM:
    """The model of a checkpoint `save_causal_lm_checkpoint` wrote; a file that does not load is one line naming
    it."""
    directory = Path(directory)
    config_path, weights = directory / "config.json", directory / "model.safetensors"
    try:
        source = json.loads(config_path.read_text())
        path = Path(source["transformers_path"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"unreadable {config_path}: {one_line(error)}") from None
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{config_path}: the model directory {path} it names has no config.json any more")
    model = load_causal_lm(path, lora=source.get("lora"), seed=0)
    try:
        model.load_trained_state_dict(load_file(weights))
    except (SafetensorError, RuntimeError, OSError, ValueError) as error:
        raise ValueError(f"cannot load {weights} into the model {config_path} describes: {one_line(error)}") from None
    return model


def export_causal_lm(model: CausalLM, out: Path) -> None:
    """`out` as a transformers directory that `AutoModelForCausalLM.from_pretrained` loads: the trained weights (a
    LoRA adapter merged in) with the source directory's tokenizer, and a LoRA run's adapter in peft's layout in
    lora/ (`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), out / "lora")`). The adapter is
    merged into `model` itself."""
    source = Path(model.source["transformers_path"])
    hf_model = model.model
    if model.lora:
        hf_model.save_pretrained(out / ADAPTER_DIR)
        hf_model = hf_model.merge_and_unload()
    hf_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)


def export_builtin_lm(model, tokenizer, out: Path) -> None:
    """A built-in task's model (a `LlamaForCausalLM` on our character tokenizer) as a transformers directory: the
    model's own `save_pretrained`, and the tokenizer as the `PreTrainedTokenizerFast` that reads the same ids."""
    model.save_pretrained(out)
    tokenizer.to_transformers().save_pretrained(out)
