"""A video flow model through `model.path`: a tiny random-init WanPipeline (a UMT5 encoder with a tokenizer made here,
a WanTransformer3DModel, an AutoencoderKLWan), saved with save_pretrained, moves as WanPipeline drives it, trains
under the reference loop and digen (Ray, 2 devices) to the same parameters with FlowGRPO and DanceGRPO, learns a
toy reward, exports what WanPipeline reloads, and shows the planner its frames; video rewards and frame strips."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import WanPipeline
from PIL import Image
from running import train
from safetensors.torch import load_file
from tiny_pipelines import PROMPTS, tiny_wan_pipeline
from typer.testing import CliRunner

from dovetail.algo import sde_step
from dovetail.cli import app
from dovetail.config.load import load_config
from dovetail.cost.catalog import diffusion_model
from dovetail.models.diffusers_flow import load_decoder, load_flow_model
from dovetail.rewards import score, temporal_smoothness

FRAMES = 5
"""Video frames a sample: 3 latent frames through the VAE's temporal stride of 2."""
STEPS = 2


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> Path:
    return tiny_wan_pipeline(tmp_path_factory.mktemp("wan"))


@pytest.fixture(scope="module")
def prompts_file(tiny_prompts_file) -> Path:
    return tiny_prompts_file


LORA = ["model.lora.rank=4", "model.lora.alpha=8.0"]


def small(wan_dir: Path, prompts_file: Path, *extra: str) -> list[str]:
    return [
        f"model.path={wan_dir}",
        "model.max_sequence_length=8",
        "model.sample_size=8",
        f"model.frames={FRAMES}",
        f"prompts.path={prompts_file}",
        "prompts.eval_fraction=0.3",
        "prompts.eval_prompts=2",
        # an image reward (each frame's, averaged) beside a video reward; weighted up so that the group std is far
        # above the advantages' epsilon, which would otherwise magnify float noise between policies
        "reward={brightness: 1000.0, temporal_smoothness: 1000.0}",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "sampling.num_steps=4",
        "sampling.shift=3.0",
        "eval.per_prompt=1",
        "eval.every=100",
        "checkpoint.every=100",
        "train.lr=3e-3",
        "cluster.devices=2",
        "runtime.profile_samples=4",  # the start-up profile only seeds the plan
        *extra,
    ]


def trained(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_the_model_moves_and_decodes_as_wan_pipeline_does(wan_dir, prompts_file):
    config = load_config(None, small(wan_dir, prompts_file))
    model, decode = load_flow_model(config), load_decoder(config)
    assert model.latent_shape == (4, 3, 8, 8)
    pipeline = WanPipeline.from_pretrained(wan_dir)
    latents = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    embeds, _ = pipeline.encode_prompt(PROMPTS[:2], do_classifier_free_guidance=False, max_sequence_length=8)
    expected = pipeline.transformer(  # WanPipeline's own step: the timestep is sigma x 1000
        hidden_states=latents, timestep=torch.full((2,), 700.0), encoder_hidden_states=embeds
    ).sample
    velocity = model(latents, torch.tensor(0.7), model.encode_prompts(PROMPTS[:2]))
    assert (velocity - expected).abs().max() <= 1e-5

    generated = [
        pipeline(
            PROMPTS[:1],
            num_frames=FRAMES,
            height=16,
            width=16,
            num_inference_steps=2,
            guidance_scale=1.0,
            max_sequence_length=8,
            generator=torch.Generator().manual_seed(1),
            output_type=kind,
        ).frames
        for kind in ("latent", "np")
    ]
    videos = decode(generated[0])
    assert videos.shape == (1, FRAMES, 16, 16, 3) and np.abs(videos - generated[1]).max() <= 1e-5


def test_a_guided_velocity_is_wan_pipelines_two_passes_combined(wan_dir, prompts_file):
    guidance = ["sampling.guidance_scale=5.0", "sampling.negative_prompt=green mat"]
    model = load_flow_model(load_config(None, small(wan_dir, prompts_file, *guidance)))
    pipeline = WanPipeline.from_pretrained(wan_dir)
    embeds, negative = pipeline.encode_prompt(
        PROMPTS[:2], negative_prompt="green mat", do_classifier_free_guidance=True, max_sequence_length=8
    )
    latents = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))

    def transformer(embeds):
        return pipeline.transformer(
            hidden_states=latents, timestep=torch.full((2,), 700.0), encoder_hidden_states=embeds
        ).sample

    conditional, unconditional = transformer(embeds), transformer(negative)
    velocity = model(latents, torch.tensor(0.7), model.encode_prompts(PROMPTS[:2]))
    assert (velocity - (unconditional + 5.0 * (conditional - unconditional))).abs().max() <= 1e-5
    assert (velocity - conditional).abs().max() > 1e-3


def test_the_sde_and_its_log_probs_see_a_video_latent_as_one_sample():
    """The SDE step reduces over every non-batch dim: a (B, C, F, H, W) latent scores what its frames folded into
    the channels score."""
    generator = torch.Generator().manual_seed(0)
    video, velocity, noise = (torch.randn(3, 4, 3, 8, 8, generator=generator) for _ in range(3))
    folded = [t.reshape(3, 12, 8, 8) for t in (video, velocity, noise)]
    for kind in ("flow_grpo", "dance_grpo", "cps"):
        step = sde_step(velocity, video, 0.8, 0.6, noise_level=0.7, kind=kind, noise=noise)
        image = sde_step(folded[1], folded[0], 0.8, 0.6, noise_level=0.7, kind=kind, noise=folded[2])
        assert torch.equal(step.prev_latents.reshape(3, 12, 8, 8), image.prev_latents)
        assert torch.allclose(step.log_prob, image.log_prob)


def test_video_rewards_take_videos_whole_and_image_rewards_average_the_frames():
    videos = np.random.default_rng(0).random((3, FRAMES, 4, 4, 3))
    videos[1] = videos[1, :1]  # a still video
    prompts = ["a", "b", "c"]
    scores = score(videos, prompts, {"brightness": 1.0, "temporal_smoothness": 2.0})
    np.testing.assert_allclose(scores["brightness"], videos.reshape(3, -1).mean(axis=1))
    np.testing.assert_allclose(scores["temporal_smoothness"], -np.abs(np.diff(videos, axis=1)).mean(axis=(1, 2, 3, 4)))
    assert scores["temporal_smoothness"][1] == 0.0 and scores["temporal_smoothness"].min() < 0
    np.testing.assert_allclose(scores["total"], scores["brightness"] + 2 * scores["temporal_smoothness"])
    images = videos[:, 0]
    assert (temporal_smoothness(images[:, None], prompts) == 0).all()
    assert (score(images, prompts, {"temporal_smoothness": 1.0})["total"] == 0).all()  # one-frame videos


@pytest.fixture(scope="module")
def flow_grpo_reference(wan_dir, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "flow-grpo"
    train(load_config(None, small(wan_dir, prompts_file, "policy=reference", *LORA)), out, steps=STEPS)
    return out


@pytest.mark.parametrize("algorithm", [[], ["algo.compat=dance_grpo"]], ids=["flow_grpo", "dance_grpo"])
def test_wan_trains_under_digen_to_the_reference_parameters(
    algorithm, flow_grpo_reference, wan_dir, prompts_file, local_ray, tmp_path
):
    """FlowGRPO with a LoRA adapter, and DanceGRPO's conventions on the whole transformer: digen on 2 Ray devices
    (fragments streaming to the trainer, TAG lending it rollouts) ends where the reference loop does."""
    run = [*algorithm, *([] if algorithm else LORA)]
    if algorithm:
        reference = tmp_path / "reference"
        train(load_config(None, small(wan_dir, prompts_file, "policy=reference", *run)), reference, steps=STEPS)
    else:
        reference = flow_grpo_reference
    start = load_file(wan_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    if algorithm:
        assert max_difference(trained(reference), start) > 1e-4  # the whole transformer trained
    else:
        assert max(v.abs().max().item() for k, v in trained(reference).items() if ".lora_B." in k) > 1e-4
    digen = ["policy=digen", "runtime.fragments=2", "runtime.tag=force"]
    train(load_config(None, small(wan_dir, prompts_file, *digen, *run)), tmp_path / "digen", steps=STEPS)
    assert max_difference(trained(tmp_path / "digen"), trained(reference)) <= 1e-5
    assert json.loads((tmp_path / "digen" / "ledger.json").read_text())["problems"] == []


def test_the_eval_is_a_frame_strip_per_sample(flow_grpo_reference):
    for name in ("eval_base.png", "eval_latest.png"):
        with Image.open(flow_grpo_reference / name) as grid:
            assert grid.width > 2 * grid.height  # two prompts' columns of 5-frame strips, one sample each


LEARNABLE = ["reward={brightness: 1.0}", "train.lr=0.3", "algo.prompts_per_step=2", "algo.group_size=8"]
"""Brightness (an image reward, each video its frames' mean), which the tiny Wan learns within 8 steps (0.428 -> 0.49
over seeds 0-3). The lr is a toy's: the random-init VAE's decoder normalises its features, so its videos barely answer
their latents (shifting a latent channel by one std moves the brightness by ~0.003), and the transformer's weights must
move by ~1 before the videos do."""


def test_flow_grpo_raises_a_toy_video_reward_in_a_few_steps(wan_dir, prompts_file, tmp_path):
    config = load_config(None, small(wan_dir, prompts_file, "policy=reference", *LEARNABLE))
    summary = train(config, tmp_path, steps=8)
    assert summary["final_eval_reward"] >= summary["base_eval_reward"] + 0.03, summary


def test_export_reloads_in_wan_pipeline_with_the_trained_weights_and_generates(flow_grpo_reference, wan_dir, tmp_path):
    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["export", str(flow_grpo_reference), str(out)])
    assert result.exit_code == 0, result.output
    pipeline = WanPipeline.from_pretrained(out)
    adapter = trained(flow_grpo_reference)
    base = load_file(wan_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    merged = dict(base)
    for name in {k.split(".lora_A.")[0] for k in adapter if ".lora_A." in k}:
        layer = name.removeprefix("base_model.model.")
        lora_a, lora_b = adapter[f"{name}.lora_A.weight"], adapter[f"{name}.lora_B.weight"]
        merged[f"{layer}.weight"] = base[f"{layer}.weight"] + 8.0 / 4 * lora_b @ lora_a  # alpha / rank
    assert max_difference(pipeline.transformer.state_dict(), merged) <= 1e-6
    assert max_difference(pipeline.transformer.state_dict(), base) > 1e-5
    assert (out / "lora" / "adapter_model.safetensors").is_file()
    with_adapter = WanPipeline.from_pretrained(wan_dir)  # diffusers' own loader reads the adapter as exported
    with_adapter.load_lora_weights(out / "lora")
    with_adapter.fuse_lora()
    with_adapter.unload_lora_weights()
    assert max_difference(with_adapter.transformer.state_dict(), merged) <= 1e-6
    video = pipeline(
        ["a red cat"],
        num_frames=FRAMES,
        height=16,
        width=16,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=8,
        output_type="np",
    ).frames
    assert video.shape == (1, FRAMES, 16, 16, 3) and np.isfinite(video).all()


def test_the_planner_prices_the_runs_frames(wan_dir, prompts_file):
    config = load_config(None, small(wan_dir, prompts_file, "policy=digen", "model.cost_model=Wan2.1-14B", *LORA))
    spec = config.scenario(3).pipelines[0]
    assert (spec.model, spec.frames, spec.height, spec.width) == ("Wan2.1-14B", FRAMES, 16, 16)
    assert diffusion_model("Wan2.1-14B").latent_tokens(spec.height, spec.width, spec.frames) == 2  # 2 latent frames
    default = load_config(None, [o for o in small(wan_dir, prompts_file) if not o.startswith("model.frames")])
    assert default.scenario(3).pipelines[0].frames == 81  # WanPipeline's default


def test_a_malformed_wan_directory_is_one_line_naming_the_file_and_the_fix(wan_dir, prompts_file, tmp_path):
    image_vae = tmp_path / "image-vae"
    shutil.copytree(wan_dir, image_vae)
    vae_config = json.loads((image_vae / "vae" / "config.json").read_text())
    (image_vae / "vae" / "config.json").write_text(json.dumps(vae_config | {"_class_name": "AutoencoderKL"}))
    two_experts = tmp_path / "two-experts"
    shutil.copytree(wan_dir, two_experts)
    index = json.loads((two_experts / "model_index.json").read_text())
    (two_experts / "model_index.json").write_text(json.dumps(index | {"transformer_2": ["diffusers", "x"]}))
    shutil.copytree(wan_dir / "transformer", two_experts / "transformer_2")
    cases = [
        ([f"model.path={image_vae}"], f"{image_vae / 'vae' / 'config.json'} holds a 'AutoencoderKL'; put the Wan"),
        ([f"model.path={two_experts}"], f"{two_experts / 'model_index.json'} lists transformer_2"),
        (
            [f"model.path={wan_dir}", "model.frames=6"],
            f"{wan_dir / 'vae'} makes 1 + a multiple of 2 frames; set model.frames=5 or 7",
        ),
        (["model.frames=5"], "model.frames is a video model's (Wan's); remove it"),
    ]
    base = [o for o in small(wan_dir, prompts_file) if not o.startswith(("model.path", "model.frames"))]
    for overrides, says in cases:
        result = CliRunner().invoke(app, ["train", *base, *overrides, "--dry-run"])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        assert says in result.output, result.output
