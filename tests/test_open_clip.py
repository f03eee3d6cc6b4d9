"""An open_clip checkpoint converted to a transformers CLIPModel (`dovetail.models.open_clip`, `dovetail convert-clip`)
computes what open_clip computes, and the `hps_v2` reward scores as HPS v2 does.

open_clip's forward is transcribed here (open_clip/transformer.py: `ResidualAttentionBlock`, `VisionTransformer`,
`TextTransformer`; open_clip/model.py: `CLIP.encode_image` / `encode_text`, normalised) and run on a tiny random
checkpoint in open_clip's naming; HPS v2's score is its score.py's: the diagonal of image_features @
text_features.T, both normalised (no logit scale)."""

import json

import numpy as np
import torch
import torch.nn.functional as F
from test_reward_models import PROMPTS, clip_directory, random_images
from transformers import CLIPModel, CLIPProcessor
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.models.open_clip import END_OF_TEXT, checkpoint_state, clip_model
from dovetail.rewards import RewardModel, RewardSources, score

torch.set_num_threads(1)
WIDTH, LAYERS, PATCH, GRID, CONTEXT, EMBED = 128, 2, 4, 4, 12, 32


def tower(prefix: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A transformer tower's residual blocks in open_clip's names, random."""

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.05

    state = {}
    for layer in range(LAYERS):
        block = f"{prefix}resblocks.{layer}."
        state |= {
            f"{block}attn.in_proj_weight": random(3 * WIDTH, WIDTH),
            f"{block}attn.in_proj_bias": random(3 * WIDTH),
        }
        state |= {f"{block}attn.out_proj.weight": random(WIDTH, WIDTH), f"{block}attn.out_proj.bias": random(WIDTH)}
        state |= {f"{block}mlp.c_fc.weight": random(4 * WIDTH, WIDTH), f"{block}mlp.c_fc.bias": random(4 * WIDTH)}
        state |= {f"{block}mlp.c_proj.weight": random(WIDTH, 4 * WIDTH), f"{block}mlp.c_proj.bias": random(WIDTH)}
        for norm in ("ln_1", "ln_2"):
            state |= {f"{block}{norm}.weight": 1 + random(WIDTH), f"{block}{norm}.bias": random(WIDTH)}
    return state


def open_clip_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A tiny open_clip ViT CLIP's state dict: width 128 (2 heads of 64), 2 layers a tower, 16 x 16 images of 4 x 4
    patches, 12 text positions, CLIP's 49408-token vocabulary, embeddings of 32."""
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.05

    state = tower("visual.transformer.", generator) | tower("transformer.", generator)
    state |= {
        "visual.conv1.weight": random(WIDTH, 3, PATCH, PATCH),
        "visual.class_embedding": random(WIDTH),
        "visual.positional_embedding": random(GRID * GRID + 1, WIDTH),
        "visual.proj": random(WIDTH, EMBED),
        "token_embedding.weight": random(END_OF_TEXT + 1, WIDTH),
        "positional_embedding": random(CONTEXT, WIDTH),
        "text_projection": random(WIDTH, EMBED),
        "logit_scale": torch.tensor(4.6052),
    }
    for norm in ("visual.ln_pre", "visual.ln_post", "ln_final"):
        state |= {f"{norm}.weight": 1 + random(WIDTH), f"{norm}.bias": random(WIDTH)}
    return state


# ------------------------------------------------------------------ open_clip, transcribed


def residual_blocks(state, prefix, x, attn_mask=None):
    for layer in range(LAYERS):
        block = f"{prefix}resblocks.{layer}."
        attention = torch.nn.MultiheadAttention(WIDTH, WIDTH // 64, batch_first=True)
        attention.load_state_dict(
            {
                "in_proj_weight": state[f"{block}attn.in_proj_weight"],
                "in_proj_bias": state[f"{block}attn.in_proj_bias"],
                "out_proj.weight": state[f"{block}attn.out_proj.weight"],
                "out_proj.bias": state[f"{block}attn.out_proj.bias"],
            }
        )
        y = F.layer_norm(x, (WIDTH,), state[f"{block}ln_1.weight"], state[f"{block}ln_1.bias"])
        x = x + attention(y, y, y, need_weights=False, attn_mask=attn_mask)[0]
        y = F.layer_norm(x, (WIDTH,), state[f"{block}ln_2.weight"], state[f"{block}ln_2.bias"])
        hidden = F.gelu(F.linear(y, state[f"{block}mlp.c_fc.weight"], state[f"{block}mlp.c_fc.bias"]))
        x = x + F.linear(hidden, state[f"{block}mlp.c_proj.weight"], state[f"{block}mlp.c_proj.bias"])
    return x


def open_clip_image_features(state, pixels):
    x = F.conv2d(pixels, state["visual.conv1.weight"], stride=PATCH)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    cls = state["visual.class_embedding"] + torch.zeros(x.shape[0], 1, x.shape[-1])
    x = torch.cat([cls, x], dim=1) + state["visual.positional_embedding"]
    x = F.layer_norm(x, (WIDTH,), state["visual.ln_pre.weight"], state["visual.ln_pre.bias"])
    x = residual_blocks(state, "visual.transformer.", x)
    pooled = F.layer_norm(x[:, 0], (WIDTH,), state["visual.ln_post.weight"], state["visual.ln_post.bias"])
    return F.normalize(pooled @ state["visual.proj"], dim=-1)


def open_clip_text_features(state, text):
    x = state["token_embedding.weight"][text] + state["positional_embedding"]
    causal = torch.full((CONTEXT, CONTEXT), float("-inf")).triu(1)
    x = residual_blocks(state, "transformer.", x, attn_mask=causal)
    x = F.layer_norm(x, (WIDTH,), state["ln_final.weight"], state["ln_final.bias"])
    return F.normalize(x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ state["text_projection"], dim=-1)


def hps_v2_score(image_features, text_features):
    """HPSv2's score.py: logits_per_image = image_features @ text_features.T; hps_score = its diagonal."""
    return torch.diagonal(image_features @ text_features.T)


# ------------------------------------------------------------------ the tests


def token_rows(seed: int) -> torch.Tensor:
    """Start-of-text, random tokens, end-of-text, zero padding: open_clip's tokenizer's layout, rows of unequal
    lengths."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.zeros(3, CONTEXT, dtype=torch.long)
    for row, length in enumerate((4, 7, CONTEXT - 2)):
        words = torch.randint(1, END_OF_TEXT - 1, (length,), generator=generator)
        rows[row, : length + 2] = torch.cat([torch.tensor([END_OF_TEXT - 1]), words, torch.tensor([END_OF_TEXT])])
    return rows


def test_a_converted_open_clip_checkpoint_embeds_images_and_texts_as_open_clip():
    state = open_clip_checkpoint(0)
    model = clip_model(checkpoint_state({"state_dict": {f"module.{k}": v for k, v in state.items()}}))
    pixels = torch.randn(3, 3, GRID * PATCH, GRID * PATCH, generator=torch.Generator().manual_seed(1))
    text = token_rows(2)
    with torch.no_grad():
        out = model(input_ids=text, pixel_values=pixels, attention_mask=(text > 0).long())
        expected_images, expected_texts = open_clip_image_features(state, pixels), open_clip_text_features(state, text)
    torch.testing.assert_close(out.image_embeds, expected_images, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.text_embeds, expected_texts, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.logit_scale.detach(), torch.tensor(4.6052))
    scores = hps_v2_score(out.image_embeds, out.text_embeds)
    torch.testing.assert_close(scores, hps_v2_score(expected_images, expected_texts), atol=1e-5, rtol=0)


def test_convert_clip_writes_a_directory_the_hps_v2_reward_loads(tmp_path):
    """`dovetail convert-clip CHECKPOINT PROCESSOR OUT`: the model converted, the processor's files beside it; the
    directory passes the reward's checks and loads as a CLIPModel with open_clip's weights."""
    state = open_clip_checkpoint(3)
    torch.save({"state_dict": state}, tmp_path / "hps.pt")
    processor = clip_directory(tmp_path / "processor", image_sign=1.0)
    result = CliRunner().invoke(app, ["convert-clip", str(tmp_path / "hps.pt"), processor, str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    loaded = CLIPModel.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(loaded.visual_projection.weight, state["visual.proj"].T)
    CLIPProcessor.from_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["CLIPModel"]
    bad = CliRunner().invoke(app, ["convert-clip", processor + "/config.json", processor, str(tmp_path / "x")])
    assert bad.exit_code == 2 and "open_clip" in bad.output and "Traceback" not in bad.output


def test_hps_v2_is_the_diagonal_of_the_normalised_features(tmp_path):
    """The reward on a tiny CLIPModel saved with save_pretrained, its images and prompts scored one by one the
    reference way: HPS v2's diagonal of image_features @ text_features.T (no logit scale, no clamp), batched."""
    directory = clip_directory(tmp_path / "clip", image_sign=1.0)
    images = random_images(4, len(PROMPTS), (16, 16, 3))
    scores = score(images, PROMPTS, {"hps_v2": 1.0}, sources=RewardSources({"hps_v2": RewardModel(directory, 2)}))
    model, processor = CLIPModel.from_pretrained(directory).eval(), CLIPProcessor.from_pretrained(directory)
    pictures = [(np.clip(image, 0, 1) * 255).round().astype(np.uint8) for image in images]
    expected = []
    for picture, prompt in zip(pictures, PROMPTS):
        inputs = processor(text=[prompt], images=[picture], truncation=True, max_length=16, return_tensors="pt")
        with torch.no_grad():
            out = model(**inputs)
        expected.append(float(hps_v2_score(out.image_embeds, out.text_embeds)[0]))
    np.testing.assert_allclose(scores["hps_v2"], expected, atol=1e-5, rtol=0)
    assert (scores["hps_v2"] < 0).all()  # this CLIP's cosines are negative: no clamp, unlike clip_score
