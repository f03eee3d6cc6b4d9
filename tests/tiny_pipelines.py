"""Tiny random-init diffusers pipelines, saved with save_pretrained, for the tests of a user's own model
(`model.path`): each builder writes a pipeline directory small enough to train in seconds on a CPU and returns its
path. The text encoders' tokenizers are made here, over the single letters of PROMPTS (no download). conftest.py
serves the SD3 one as the session fixture `sd3_pipeline_dir`, and PROMPTS as `tiny_prompts_file`."""

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from tokenizers import Tokenizer, models
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
)

PROMPTS = ["a red cat", "a blue dog", "red house", "blue mat", "a green cat", "the red dog", "blue cat", "green mat"]
LETTERS = sorted(set("".join(PROMPTS)))
"""The tokenizers' alphabet: every letter of PROMPTS, and only those."""


def clip_tokenizer(directory: Path) -> tuple[CLIPTokenizer, int]:
    """CLIP's BPE over single letters (a vocabulary written here, no merges) and its vocabulary size."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in LETTERS:
        vocab.setdefault(letter, len(vocab))
        vocab.setdefault(letter + "</w>", len(vocab))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=16), len(vocab)


def tiny_clip_config(vocab_size: int, num_hidden_layers: int, **changes) -> CLIPTextConfig:
    """A CLIP text encoder of width 16 and 16 positions over `clip_tokenizer`'s vocabulary."""
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        **changes,
    )


def tiny_vae() -> AutoencoderKL:
    """Four latent channels, one 2x upsampling: 8x8 latents are 16x16 RGB images."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[8, 16],
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        scaling_factor=1.5,
        shift_factor=0.1,
    )


def tiny_sd3_pipeline(directory: Path, **transformer) -> Path:
    """A random-init StableDiffusion3Pipeline small enough to train in seconds (two CLIP text encoders, an MMDiT, a
    VAE), saved with save_pretrained under `directory`; returns the pipeline's directory. SD3's T5 is left out, as
    diffusers allows (its encodings are then zeros). `transformer`: the MMDiT's config fields to change (its width
    and depth: benchmarks/sharded_runtime.py widens it to SD3-medium's blocks behind the same tiny encoders)."""
    torch.manual_seed(0)
    tokenizer, vocab_size = clip_tokenizer(directory)
    text = tiny_clip_config(vocab_size, num_hidden_layers=2, projection_dim=16)
    mmdit = {
        "sample_size": 8,
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "attention_head_dim": 8,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,  # the two CLIPs' hidden states side by side
        "caption_projection_dim": 16,
        "pooled_projection_dim": 32,  # their two projections side by side
        "pos_embed_max_size": 8,
    }
    pipeline = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**(mmdit | transformer)),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_vae(),
        text_encoder=CLIPTextModelWithProjection(text),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(text),
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipeline.save_pretrained(directory / "pipeline")
    return directory / "pipeline"


def tiny_flux_pipeline(directory: Path) -> Path:
    """A random-init guidance-distilled FluxPipeline (CLIP for the pooled embedding, a T5 encoder with a unigram
    tokenizer of single letters made here), saved with save_pretrained under `directory`; returns the pipeline's
    directory."""
    torch.manual_seed(0)
    tokenizer, vocab_size = clip_tokenizer(directory)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(letter, -1.0) for letter in LETTERS]
    unigram = Tokenizer(models.Unigram(pieces, unk_id=2))
    clip = tiny_clip_config(vocab_size, num_hidden_layers=1)
    pipeline = FluxPipeline(
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels in 2x2 patches
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            guidance_embeds=True,
            axes_dims_rope=(2, 2, 4),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(),
        text_encoder=CLIPTextModel(clip),
        tokenizer=tokenizer,
        text_encoder_2=T5EncoderModel(
            T5Config(vocab_size=len(pieces), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        ),
        tokenizer_2=T5TokenizerFast(
            tokenizer_object=unigram, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0
        ),
    )
    pipeline.save_pretrained(directory / "pipeline")
    return directory / "pipeline"


def tiny_wan_pipeline(directory: Path) -> Path:
    """A random-init WanPipeline small enough to train in seconds, saved with save_pretrained: UMT5 on a unigram
    tokenizer of single letters, a one-layer WanTransformer3DModel over 4 latent channels, an AutoencoderKLWan with
    one 2x down/upsampling in space and in time (latent (4, 3, 8, 8) is a 5-frame 16x16 video), its latents
    normalised by a per-channel mean and std as Wan's are."""
    torch.manual_seed(0)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(letter, -1.0) for letter in LETTERS]
    tokenizer = T5TokenizerFast(
        tokenizer_object=Tokenizer(models.Unigram(pieces, unk_id=2)),
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_ids=0,
    )
    pipeline = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=UMT5EncoderModel(
            UMT5Config(vocab_size=len(pieces), d_model=16, d_kv=8, d_ff=16, num_layers=1, num_heads=2)
        ),
        transformer=WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=16,
            num_layers=1,
            rope_max_seq_len=32,
        ),
        vae=AutoencoderKLWan(
            base_dim=4,
            z_dim=4,
            dim_mult=[1, 1],
            num_res_blocks=1,
            temperal_downsample=[True],
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.5, 1.0, 2.0],
            scale_factor_temporal=2,
            scale_factor_spatial=2,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipeline.save_pretrained(directory / "pipeline")
    return directory / "pipeline"
