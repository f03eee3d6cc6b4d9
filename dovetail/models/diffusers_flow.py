"""A user's own diffusers flow model, behind the interface the engines use (the built-in `TinyT2I`'s).

`model.path` names a diffusers directory in `save_pretrained` layout: a pipeline (model_index.json, transformer/,
scheduler/, text_encoder*/, tokenizer*/, vae/), or transformer/ beside precomputed prompt embeddings
(prompt_embeds.safetensors, see `save_prompt_embeddings`) and, where the latents are not the image, vae/. The
transformer trains (all of it, or a peft LoRA adapter); the text encoders and the VAE stay frozen, shared by the
trainer, rollout and reference copies of one process, and encode prompts (with the pipeline's own `encode_prompt`,
as upstream Flow-GRPO does) or decode latents into the images the rewards score.

Images (SD3, FLUX) or videos (Wan: `WanFlow`, latents (B, C, F, H, W), decoded into (B, frames, H, W, 3)): the
samplers, the SDE's log-probs and the losses reduce over every non-batch dim, so the frames change nothing there.

What the engines see of either model: `latent_shape`, `device`, `encode_prompts(prompts)` (one tensor per prompt),
`forward(latents, sigma, encoding)` (the velocity, classifier-free guided with sampling.guidance_scale: so rollouts,
training and evaluation step with one velocity), and `trained_state_dict` / `load_trained_state_dict`: what weight
publication, trainer hand-over and checkpoints carry (a LoRA run's adapter alone).
"""

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
import transformers
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)
from pydantic import ConfigDict, TypeAdapter
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from dovetail.files import one_line
from dovetail.models.memory import counted_on_meta
from dovetail.models.t2i import latents_to_images, load_model, save_model
from dovetail.models.training import has_lora, load_lora_state_dict, lora_state_dict, with_lora
from dovetail.prompts import prompt_split

PROMPT_EMBEDDINGS = "prompt_embeds.safetensors"
"""Precomputed prompt encodings of a directory without text encoders: tensors prompt_embeds (N, L, D) and
pooled_prompt_embeds (N, P) (P = 0 for Wan, which has no pooled embedding), and the N prompts (a JSON list) in the
file's metadata under "prompts"."""

ADAPTER_DIR = "lora"
"""Where `export` writes a LoRA run's adapter, inside the exported pipeline directory: in peft's layout and in
diffusers' (`export_adapter`)."""


@dataclass(frozen=True)
class DiffusersSource:
    """What a user's diffusers flow model is built from (`load_diffusers_flow`): the run config's model and sampling
    settings (`load_flow_model`), or a checkpoint's config.json (`load_diffusers_checkpoint`), which holds a model's
    `source` to build it again. A default is what a checkpoint written before its field existed meant."""

    diffusers_path: str
    """The diffusers directory (a model's `source`: resolved)."""
    max_sequence_length: int
    """T5 tokens of an SD3 pipeline's prompt encoding (its encode_prompt's)."""
    lora: dict[str, Any] | None = None
    """The peft LoRA adapter trained on the transformer (rank, alpha, target_modules); None: the whole transformer."""
    sample_size: int | None = None
    """Latent pixels a side; None: the transformer's own, or FluxPipeline's default (a model's `source`: the size it
    took)."""
    guidance: float = 3.5
    """A guidance-distilled FLUX's guidance."""
    frames: int = 1
    """A video model's frames a sample (1 + a multiple of its VAE's temporal stride); 1 for images."""
    guidance_scale: float = 1.0
    """Classifier-free guidance's scale (1.0: none)."""
    negative_prompt: str = ""
    """Classifier-free guidance's negative prompt."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # a field it does not know is no config.json of a source

    @classmethod
    def from_json(cls, fields: object) -> "DiffusersSource":
        """The source a checkpoint's config.json holds, each field checked (a pydantic ValidationError, a ValueError,
        for one that is missing, unknown or of the wrong type)."""
        return SOURCE_FIELDS.validate_python(fields)


SOURCE_FIELDS = TypeAdapter(DiffusersSource)
"""`DiffusersSource.from_json`'s check."""


class Frozen:
    """A frozen part of the model (text encoders, prompt table): copies of the model share it, so the rollout and
    reference copies of a trainer do not hold the encoders two and three times."""

    def __deepcopy__(self, memo):
        return self


class PipelinePrompts(Frozen):
    """Prompts encoded by the pipeline's own `encode_prompt` (SD3: CLIP-L and CLIP-G, T5 where present; FLUX: CLIP
    pooled, T5 tokens; Wan: UMT5 tokens, no pooled embedding: a zero-width one), without encode_prompt's negative
    branch: classifier-free guidance's negative prompt is encoded once as a prompt of its own (`DiffusersFlow`)."""

    def __init__(self, pipeline, max_sequence_length: int):
        self.pipeline = pipeline
        self.max_sequence_length = max_sequence_length
        names = ("text_encoder", "text_encoder_2", "text_encoder_3")
        self.encoders = [getattr(pipeline, n) for n in names if getattr(pipeline, n, None) is not None]
        for encoder in self.encoders:
            encoder.requires_grad_(False).eval()

    def to(self, device: torch.device) -> None:
        for encoder in self.encoders:
            encoder.to(device)

    @torch.no_grad()
    def encode(self, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        kind = type(self.pipeline).__name__
        if kind == "FluxPipeline":
            embeds, pooled, _ = self.pipeline.encode_prompt(
                prompts, None, device=device, max_sequence_length=self.max_sequence_length
            )
        elif kind == "WanPipeline":
            embeds, _ = self.pipeline.encode_prompt(
                prompts, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length, device=device
            )
            pooled = embeds.new_zeros(len(embeds), 0)
        else:
            embeds, _, pooled, _ = self.pipeline.encode_prompt(
                prompts,
                None,
                None,
                device=device,
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )
        return embeds.float(), pooled.float()


class PrecomputedPrompts(Frozen):
    """Prompt encodings looked up in a prompt_embeds.safetensors: the prompts a run uses must all be there."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with safe_open(path, "pt") as f:
                prompts = json.loads((f.metadata() or {}).get("prompts", "null"))
            tensors = load_file(path)
        except (OSError, SafetensorError, ValueError) as error:
            raise ValueError(f"unreadable {path}: {one_line(error)}") from None
        embeds, pooled = tensors.get("prompt_embeds"), tensors.get("pooled_prompt_embeds")
        if (
            not isinstance(prompts, list)
            or embeds is None
            or pooled is None
            or embeds.ndim != 3
            or pooled.ndim != 2
            or not len(prompts) == len(embeds) == len(pooled)
        ):
            raise ValueError(
                f"{path} must hold prompt_embeds (N, L, D), pooled_prompt_embeds (N, P) and its N prompts in the "
                "metadata; write it with dovetail.models.diffusers_flow.save_prompt_embeddings"
            )
        self.row = {prompt: i for i, prompt in enumerate(prompts)}
        self.embeds, self.pooled = embeds.float(), pooled.float()

    def to(self, device: torch.device) -> None:
        """The table stays on the CPU; `encode` moves the rows a batch needs."""

    def encode(self, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        missing = [p for p in prompts if p not in self.row]
        if missing:
            raise ValueError(
                f"prompt {missing[0]!r} has no precomputed encoding in {self.path}: add it, or give a pipeline "
                "directory with text encoders as model.path"
            )
        rows = [self.row[p] for p in prompts]
        return self.embeds[rows].to(device), self.pooled[rows].to(device)


def save_prompt_embeddings(path: Path | str, prompts: list[str], embeds: torch.Tensor, pooled: torch.Tensor) -> None:
    """Write the prompt encodings of a directory without text encoders (e.g. from the pipeline's encode_prompt)."""
    tensors = {"prompt_embeds": embeds.float().contiguous(), "pooled_prompt_embeds": pooled.float().contiguous()}
    save_file(tensors, str(path), metadata={"prompts": json.dumps(list(prompts))})


class DiffusersFlow(torch.nn.Module):
    """Velocity model v(x_sigma, sigma, prompt) of a diffusers SD3-style MMDiT; `transformer` may carry a peft LoRA
    adapter (then only the adapter trains)."""

    PIPELINE = "StableDiffusion3Pipeline"
    """The diffusers pipeline whose `encode_prompt` encodes this transformer's prompts."""

    BATCHED_GUIDANCE = True
    """Whether classifier-free guidance runs the unconditional and conditional branches as one forward of 2B, as
    StableDiffusion3Pipeline does (FluxPipeline's true CFG and WanPipeline run two forwards of B)."""

    def __init__(self, transformer: SD3Transformer2DModel, prompts, num_train_timesteps: int, source: DiffusersSource):
        super().__init__()
        self.transformer = transformer
        self.prompts = prompts
        self.num_train_timesteps = num_train_timesteps
        self.source = source
        """How to build this model again: the directory, the LoRA settings, the T5 length, the guidance (a
        checkpoint's config)."""
        self._text_dims = self.text_widths(self.transformer_config)
        self.guidance_scale = source.guidance_scale
        if self.guidance_scale != 1.0:
            # encoded once, as Flow-GRPO encodes its negative prompt once; a buffer, so it moves with the model and
            # stays out of every state dict
            negative = self.encode_prompts([source.negative_prompt])
            self.register_buffer("negative_encoding", negative, persistent=False)

    @staticmethod
    def text_widths(config) -> tuple[int, int]:
        """(token embedding width, pooled embedding width) of the prompt encodings the transformer takes."""
        return config.joint_attention_dim, config.pooled_projection_dim

    @property
    def transformer_config(self):
        base = self.transformer.get_base_model() if self.lora else self.transformer
        return base.config

    @property
    def lora(self) -> bool:
        return has_lora(self.transformer)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """One sample's latents: (C, H, W) of an image, (C, F, H, W) of a video (`WanFlow`)."""
        config = self.transformer_config
        return (config.in_channels, config.sample_size, config.sample_size)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the shared text encoders too (they are no sub-modules: see `Frozen`)."""
        super()._apply(fn, recurse)
        self.prompts.to(self.device)
        return self

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """Each prompt's encoding as one row: its token embeddings (L x D) flattened, then its pooled embedding (P)."""
        embeds, pooled = self.prompts.encode(list(prompts), self.device)
        width, pooled_width = self._text_dims
        if embeds.shape[-1] != width or pooled.shape[-1] != pooled_width:
            raise ValueError(
                f"the prompt encodings have widths {embeds.shape[-1]} and {pooled.shape[-1]}, the transformer "
                f"takes joint_attention_dim={width} and pooled_projection_dim={pooled_width}"
            )
        return torch.cat([embeds.flatten(1), pooled], dim=1)

    def forward(self, latents: torch.Tensor, sigma: torch.Tensor, encoding: torch.Tensor) -> torch.Tensor:
        """The velocity the sampler steps with and training scores: with sampling.guidance_scale s != 1 the
        classifier-free guided v_neg + s (v - v_neg), v_neg the velocity on the negative prompt's encoding, as
        diffusers' pipelines and Flow-GRPO (in rollouts and in training alike) compute it; else the transformer's."""
        if self.guidance_scale == 1.0:
            return self.velocity(latents, sigma, encoding)
        sigma = sigma.expand(len(latents))
        negative = self.negative_encoding.expand(len(encoding), -1)
        if self.BATCHED_GUIDANCE:
            both = self.velocity(
                torch.cat([latents, latents]), torch.cat([sigma, sigma]), torch.cat([negative, encoding])
            )
            unconditional, conditional = both.chunk(2)
        else:
            conditional = self.velocity(latents, sigma, encoding)
            unconditional = self.velocity(latents, sigma, negative)
        return unconditional + self.guidance_scale * (conditional - unconditional)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, encoding: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity on the prompts' encodings, unguided."""
        width, pooled_width = self._text_dims
        embeds = encoding[:, :-pooled_width].reshape(len(encoding), -1, width)
        timestep = sigma.expand(latents.shape[0]) * self.num_train_timesteps
        return self.transformer(
            hidden_states=latents,
            encoder_hidden_states=embeds,
            pooled_projections=encoding[:, -pooled_width:],
            timestep=timestep,
        ).sample

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """What trains: the LoRA adapter's tensors, or the whole transformer's."""
        return lora_state_dict(self.transformer) if self.lora else self.transformer.state_dict()

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not self.lora:
            self.transformer.load_state_dict(state)
            return
        load_lora_state_dict(self.transformer, state)


class FluxFlow(DiffusersFlow):
    """A FLUX transformer behind the same interface: the engines' latents (B, C, H, W) are packed into FLUX's
    2x2-patch tokens with their position ids on the way in and unpacked on the way out, as FluxPipeline does; its
    timestep is sigma itself; a guidance-distilled transformer (FLUX.1-dev) gets `guidance` as its embedding's
    input."""

    PIPELINE = "FluxPipeline"
    BATCHED_GUIDANCE = False

    def __init__(self, transformer, prompts, num_train_timesteps: int, source: DiffusersSource):
        super().__init__(transformer, prompts, num_train_timesteps, source)
        assert source.sample_size is not None  # load_diffusers_flow resolves it
        self.sample_size = source.sample_size
        self.guidance = source.guidance

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.transformer_config.in_channels // 4, self.sample_size, self.sample_size)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, encoding: torch.Tensor) -> torch.Tensor:
        width, pooled_width = self._text_dims
        embeds = encoding[:, :-pooled_width].reshape(len(encoding), -1, width)
        batch, channels, height, breadth = latents.shape
        tokens = latents.view(batch, channels, height // 2, 2, breadth // 2, 2).permute(0, 2, 4, 1, 3, 5)
        image_ids = torch.zeros(height // 2, breadth // 2, 3, device=latents.device)
        image_ids[..., 1] += torch.arange(height // 2, device=latents.device)[:, None]
        image_ids[..., 2] += torch.arange(breadth // 2, device=latents.device)[None, :]
        guidance = None
        if self.transformer_config.guidance_embeds:
            guidance = torch.full((batch,), self.guidance, device=latents.device)
        velocity = self.transformer(
            hidden_states=tokens.reshape(batch, (height // 2) * (breadth // 2), channels * 4),
            encoder_hidden_states=embeds,
            pooled_projections=encoding[:, -pooled_width:],
            timestep=sigma.expand(batch),
            img_ids=image_ids.reshape(-1, 3),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=latents.device),
            guidance=guidance,
        ).sample
        velocity = velocity.view(batch, height // 2, breadth // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return velocity.reshape(batch, channels, height, breadth)


class WanFlow(DiffusersFlow):
    """A Wan text-to-video transformer behind the same interface: latents (B, C, F, H, W), F the latent frames of
    `frames` video frames (1 + (frames - 1) / the VAE's temporal stride, as WanPipeline lays them), square
    `sample_size` latent pixels a side; the prompt is UMT5's token embeddings alone and the timestep sigma x
    num_train_timesteps, as WanPipeline drives it (classifier-free guidance, where set, as its two forwards)."""

    PIPELINE = "WanPipeline"
    BATCHED_GUIDANCE = False

    def __init__(self, transformer, prompts, num_train_timesteps: int, source: DiffusersSource):
        super().__init__(transformer, prompts, num_train_timesteps, source)
        stride = temporal_stride(Path(source.diffusers_path))
        self.latent_frames = (source.frames - 1) // stride + 1
        assert source.sample_size is not None  # load_diffusers_flow resolves it
        self.sample_size = source.sample_size

    @staticmethod
    def text_widths(config) -> tuple[int, int]:
        return config.text_dim, 0

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.transformer_config.in_channels, self.latent_frames, self.sample_size, self.sample_size)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, encoding: torch.Tensor) -> torch.Tensor:
        width, _ = self._text_dims
        return self.transformer(
            hidden_states=latents,
            encoder_hidden_states=encoding.reshape(len(encoding), -1, width),
            timestep=sigma.expand(latents.shape[0]) * self.num_train_timesteps,
        ).sample


def temporal_stride(path: Path) -> int:
    """Video frames per latent frame of a Wan directory's VAE (WanPipeline's default where its config has none)."""
    return json.loads((path / "vae" / "config.json").read_text()).get("scale_factor_temporal") or 4


TRANSFORMERS = {
    "SD3Transformer2DModel": (SD3Transformer2DModel, DiffusersFlow),
    "FluxTransformer2DModel": (FluxTransformer2DModel, FluxFlow),
    "WanTransformer3DModel": (WanTransformer3DModel, WanFlow),
}
"""A transformer's _class_name -> its diffusers class and the wrapper the engines use."""

FLUX_SAMPLE_SIZE = 128
"""FluxPipeline's default latent size (1024-pixel images): FLUX's transformer config has none of its own."""


def transformer_parameter_counts(path: Path | str, *, lora: dict | None, seed: int) -> tuple[int, int]:
    """(parameters, trained parameters) of a diffusers directory's transformer with `lora`, from its config alone
    (the text encoders and VAE, frozen and beside the trainer, are not counted)."""
    directory = Path(path) / "transformer"
    kind, _ = TRANSFORMERS[json.loads((directory / "config.json").read_text())["_class_name"]]

    def build():
        transformer = kind.from_config(kind.load_config(directory))
        return with_lora(transformer, lora, seed) if lora is not None else transformer

    return counted_on_meta(build)


def load_diffusers_flow(source: DiffusersSource, *, seed: int) -> DiffusersFlow:
    """The flow model of `source`'s diffusers directory (`config.flow.ModelSection` has checked its layout), in eval
    mode; `seed` draws a new LoRA adapter's initial weights. Its `source` is the one given with the directory
    resolved and the sample size it took."""
    path = Path(source.diffusers_path).resolve()
    diffusers.utils.logging.disable_progress_bar()  # the run's own display says what start-up is doing
    transformers.utils.logging.disable_progress_bar()
    kind, wrapper = TRANSFORMERS[json.loads((path / "transformer" / "config.json").read_text())["_class_name"]]
    transformer = kind.from_pretrained(path / "transformer", dtype=torch.float32)
    prompts: PrecomputedPrompts | PipelinePrompts
    if (path / PROMPT_EMBEDDINGS).is_file():
        prompts = PrecomputedPrompts(path / PROMPT_EMBEDDINGS)
    else:
        prompts = PipelinePrompts(_text_pipeline(path, transformer, wrapper.PIPELINE), source.max_sequence_length)
    scheduler_config = path / "scheduler" / "scheduler_config.json"
    timesteps = (
        json.loads(scheduler_config.read_text()).get("num_train_timesteps", 1000)
        if scheduler_config.is_file()
        else 1000
    )
    if source.lora is not None:
        transformer = with_lora(transformer, source.lora, seed)
    sample_size = source.sample_size or getattr(transformer.config, "sample_size", None) or FLUX_SAMPLE_SIZE
    source = replace(source, diffusers_path=str(path), sample_size=sample_size)
    return wrapper(transformer, prompts, timesteps, source).eval()


def _text_pipeline(path: Path, transformer, kind: str):
    """The directory's pipeline of class `kind` (StableDiffusion3Pipeline, FluxPipeline, WanPipeline) of its text
    encoders and tokenizers (an absent one, e.g. SD3's T5 left out, None), in float32; the transformer is the model's
    own (SD3's encode_prompt reads its config), no VAE.
    Looked up here: diffusers' pipelines pull in transformers' image processors, which no other run needs (nor this
    one: their warnings that torchvision is missing are silenced)."""
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        pipeline = getattr(diffusers, kind)
    finally:
        transformers.utils.logging.set_verbosity(verbosity)

    index = json.loads((path / "model_index.json").read_text())
    optional = ("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor")
    absent = {name: None for name in optional if name in index and index[name][0] is None}
    return pipeline.from_pretrained(path, transformer=transformer, vae=None, dtype=torch.float32, **absent)


class VaeDecoder:
    """Latents to images in [0, 1] through the directory's VAE: (B, H, W, 3) for RGB, (B, H, W) for one channel."""

    def __init__(self, vae: AutoencoderKL, device: torch.device | str):
        self.vae = vae.requires_grad_(False).eval().to(device)

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> np.ndarray:
        config = self.vae.config
        latents = latents.to(next(self.vae.parameters()).device) / config.scaling_factor + (config.shift_factor or 0.0)
        images = (self.vae.decode(latents).sample / 2 + 0.5).clamp(0, 1).float()
        return _channels_last(images)


class WanVaeDecoder(VaeDecoder):
    """Video latents (B, C, F, H, W) to videos (B, frames, H, W, 3) in [0, 1] through AutoencoderKLWan, its
    per-channel latents_mean and latents_std undone first, as WanPipeline does."""

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> np.ndarray:
        config = self.vae.config
        device = next(self.vae.parameters()).device
        mean = torch.tensor(config.latents_mean, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=device).view(1, -1, 1, 1, 1)
        videos = (self.vae.decode(latents.to(device) * std + mean).sample / 2 + 0.5).clamp(0, 1).float()
        return videos.permute(0, 2, 3, 4, 1).cpu().numpy()


def _channels_last(images: torch.Tensor) -> np.ndarray:
    if images.shape[1] == 1:
        return images[:, 0].cpu().numpy()
    return images.permute(0, 2, 3, 1).cpu().numpy()


def latents_as_rgb(latents: torch.Tensor) -> np.ndarray:
    """A VAE-free model's 3-channel latents in [-1, 1] as RGB images in [0, 1]."""
    return _channels_last((latents.detach().float().clamp(-1, 1) + 1) / 2)


# ---------------------------------------------------------------- what a run loads, saves and exports


def load_flow_model(config) -> torch.nn.Module:
    """A flow run's model: the built-in checkpoint's, or the diffusers directory's of `model.path`."""
    section = config.model
    if section.path is None:
        return load_model(section.checkpoint)
    check_prompt_table(config)
    source = DiffusersSource(
        diffusers_path=str(section.path),
        max_sequence_length=section.max_sequence_length,
        lora=None if section.lora is None else section.lora.model_dump(),
        sample_size=section.sample_size,
        guidance=section.guidance,
        frames=section.frames,
        guidance_scale=config.sampling.guidance_scale,
        negative_prompt=config.sampling.negative_prompt,
    )
    return load_diffusers_flow(source, seed=config.seed)


def check_prompt_table(config) -> None:
    """A model.path of precomputed prompt encodings holds one for every prompt of the run (train and eval, and the
    negative prompt of a guided run): else one line naming the first that lacks one, before any work (reads the
    table's metadata alone)."""
    table = Path(config.model.path) / PROMPT_EMBEDDINGS
    if not table.is_file():
        return
    try:
        with safe_open(table, "pt") as f:
            known = set(json.loads((f.metadata() or {}).get("prompts", "[]")))
    except (OSError, SafetensorError, ValueError) as error:
        raise ValueError(f"unreadable {table}: {one_line(error)}") from None
    split = prompt_split(config)
    sampling = config.sampling
    negative = [sampling.negative_prompt] if sampling.guidance_scale != 1.0 else []
    missing = [p for p in dict.fromkeys((*split.train, *split.eval, *negative)) if p not in known]
    if missing:
        raise ValueError(
            f"prompt {missing[0]!r} ({len(missing)} of the run's prompts in all) has no precomputed encoding in "
            f"{table}: add them, or give a pipeline directory with text encoders as model.path"
        )


def load_decoder(config, device: torch.device | str = "cpu") -> Callable[[torch.Tensor], np.ndarray]:
    """Latents to the images (videos: a Wan directory's AutoencoderKLWan) the rewards score: the directory's VAE, or
    the latents themselves where there is none (the built-in model's one channel; a VAE-free directory's one or
    three)."""
    path = config.model.path
    if path is not None and (Path(path) / "vae").is_dir():
        vae = Path(path) / "vae"
        if json.loads((vae / "config.json").read_text())["_class_name"] == "AutoencoderKLWan":
            return WanVaeDecoder(AutoencoderKLWan.from_pretrained(vae, dtype=torch.float32), device)
        return VaeDecoder(AutoencoderKL.from_pretrained(vae, dtype=torch.float32), device)
    if path is not None and _in_channels(Path(path)) == 3:
        return latents_as_rgb
    return latents_to_images


def _in_channels(path: Path) -> int:
    return json.loads((path / "transformer" / "config.json").read_text())["in_channels"]


def save_diffusers_checkpoint(model: DiffusersFlow, directory: Path) -> None:
    """A checkpoint's model files: model.safetensors the trained tensors (a LoRA run's adapter alone), config.json
    how to build the model they fit (the directory they came from, the LoRA settings)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous() for k, v in model.trained_state_dict().items()}, directory / "model.safetensors"
    )
    (directory / "config.json").write_text(json.dumps(asdict(model.source), indent=2))


def load_diffusers_checkpoint(directory: Path | str) -> DiffusersFlow:
    """The model of a checkpoint `save_diffusers_checkpoint` wrote; a file that does not load is one line naming it."""
    directory = Path(directory)
    config_path, weights = directory / "config.json", directory / "model.safetensors"
    try:
        source = DiffusersSource.from_json(json.loads(config_path.read_text()))
    except (OSError, ValueError) as error:
        raise ValueError(f"unreadable {config_path}: {one_line(error)}") from None
    path = Path(source.diffusers_path)
    if not (path / "transformer").is_dir():
        raise FileNotFoundError(f"{config_path}: the model directory {path} it names has no transformer/ any more")
    model = load_diffusers_flow(source, seed=0)
    try:
        model.load_trained_state_dict(load_file(weights))
    except (SafetensorError, RuntimeError, OSError, ValueError) as error:
        raise ValueError(f"cannot load {weights} into the model {config_path} describes: {one_line(error)}") from None
    return model


def checkpoint_io(config, model) -> tuple[Callable, Callable]:
    """(save_weights, load_weights) of a flow run's checkpoints for `RunDir`: the built-in model's own format, or a
    diffusers model's."""
    if config.model.path is None:
        return (lambda directory: save_model(model, directory)), load_model
    return (lambda directory: save_diffusers_checkpoint(model, directory)), load_diffusers_checkpoint


def export(model: DiffusersFlow, out: Path) -> None:
    """`out` as a diffusers directory that `from_pretrained` loads: the source directory's files with the trained
    transformer in transformer/ (a LoRA adapter merged in), and a LoRA run's adapter in lora/ (`export_adapter`).
    The adapter is merged into `model` itself."""
    source = Path(model.source.diffusers_path)
    shutil.copytree(source, out, ignore=lambda d, names: ["transformer"] if Path(d) == source else [])
    transformer = model.transformer
    if model.lora:
        export_adapter(model, out / ADAPTER_DIR)
        transformer = transformer.merge_and_unload()
    transformer.save_pretrained(out / "transformer")


def export_adapter(model: DiffusersFlow, out: Path) -> None:
    """A LoRA run's adapter in `out` as both loaders read it: peft's (adapter_config.json, adapter_model.safetensors:
    `PeftModel.from_pretrained(transformer, out)`) and diffusers' (pytorch_lora_weights.safetensors, which its
    pipelines' loader picks first: `pipeline.load_lora_weights(out)`; a transformer's `load_lora_adapter` is given it
    as `weight_name`). diffusers' is
    written by the pipeline's own `save_lora_weights`, as its LoRA training scripts write theirs: the peft keys
    under "transformer." (peft's "base_model.model." off: with it, diffusers' loader finds no key of the transformer
    and loads nothing, without an error) and the LoRA config (alpha, rank, targets) in the file's metadata, which
    it reads back rather than guess a scale of 1 from the shapes."""
    transformer = model.transformer
    transformer.save_pretrained(out)
    layers = {name.removeprefix("base_model.model."): tensor for name, tensor in lora_state_dict(transformer).items()}
    getattr(diffusers, model.PIPELINE).save_lora_weights(
        out,
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata=transformer.peft_config[transformer.active_adapter].to_dict(),
    )
