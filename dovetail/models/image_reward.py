"""An ImageReward checkpoint (THUDM's `ImageReward.pt`) as a transformers `BlipForImageTextRetrieval` directory
and ImageReward's score head beside it: how a user brings ImageReward to the `image_reward` reward
(`dovetail convert-imagereward`).

ImageReward (ImageReward/ImageReward.py) is BLIP's pre-training model (`blip`: models/BLIP/blip_pretrain.py) and an
MLP (`mlp`). transformers' BLIP retrieval model computes the same function as the two BLIP parts ImageReward's score
runs, under other names:

* `blip.visual_encoder`, BLIP's ViT (models/BLIP/vit.py): `patch_embed.proj` (a convolution with bias) is the
  patch embedding, `cls_token` and `pos_embed` the class and position embeddings, each pre-norm block's `norm1`,
  fused `attn.qkv` (q, k and v stacked, as BlipAttention's `qkv`), `attn.proj`, `norm2`, `mlp.fc1`, `mlp.fc2` a
  BLIP encoder layer's `layer_norm1`, `self_attn.qkv`, `self_attn.projection`, `layer_norm2`, `mlp.fc1`,
  `mlp.fc2`; its final `norm`, applied to every token, is BlipVisionModel's `post_layernorm` (which its
  last_hidden_state passes through). LayerNorm eps 1e-6 (timm's, BLIP's `norm_layer`), exact GELU.
* `blip.text_encoder`, med.py's BertModel with cross-attention to the image tokens in every layer: transformers'
  BlipTextModel is med.py ported (word and position embeddings, no token types; `attention`, `crossattention`,
  `intermediate`, `output` of each layer under the same names), the cross-attention built where the text config
  `is_decoder`, and run bidirectionally as BlipForImageTextRetrieval's ITM branch runs it. LayerNorm eps 1e-12
  (ImageReward's med_config.json).
* `blip.vision_proj` / `blip.text_proj`: the retrieval model's projections (ImageReward's score reads neither).

The sizes are read off the tensors' shapes; the heads are width / 64, the head width of every BLIP config
(ViT-L: 1024 / 16, ViT-B: 768 / 12, med_config.json's BERT: 768 / 12), so no med_config.json is needed.
ImageReward has no image-text matching head: the model's `itm_head` is left at zero, and the score comes from
ImageReward's MLP, saved in upstream's names (`layers.0`, `.2`, `.4`, `.6`, `.7`: the Linear layers between its
Dropouts) as `rewards.models.IMAGE_REWARD_HEAD` beside the model."""

import re

import torch
from transformers import BlipConfig, BlipForImageTextRetrieval

HEAD_WIDTH = 64
"""The width of an attention head in BLIP's ViTs and its BERT (hidden size / heads in each of its configs)."""

VISION = "blip.visual_encoder."
TEXT = "blip.text_encoder."


def checkpoint_state(loaded: object) -> dict[str, torch.Tensor]:
    """The state dict of a loaded ImageReward checkpoint (`ImageReward.pt` is one; a `state_dict` entry is taken
    where training wrapped it), without DistributedDataParallel's `module.` prefix."""
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
    marker = f"{VISION}patch_embed.proj.weight"
    if not isinstance(state, dict) or marker not in {str(k).removeprefix("module.") for k in state}:
        raise ValueError(f"is not an ImageReward checkpoint (no {marker} in its state dict)")
    return {str(key).removeprefix("module."): value for key, value in state.items()}


def _layers(state: dict[str, torch.Tensor], pattern: str) -> int:
    return len({int(m[1]) for key in state if (m := re.match(pattern, key))})


def blip_config(state: dict[str, torch.Tensor]) -> BlipConfig:
    """The BlipConfig of an ImageReward checkpoint, its sizes read from the tensors."""
    vision_width, _, patch, _ = state[f"{VISION}patch_embed.proj.weight"].shape
    grid = round((state[f"{VISION}pos_embed"].shape[1] - 1) ** 0.5)
    vocabulary, text_width = state[f"{TEXT}embeddings.word_embeddings.weight"].shape
    vision = {
        "hidden_size": vision_width,
        "intermediate_size": state[f"{VISION}blocks.0.mlp.fc1.weight"].shape[0],
        "num_hidden_layers": _layers(state, rf"{re.escape(VISION)}blocks\.(\d+)\."),
        "num_attention_heads": vision_width // HEAD_WIDTH,
        "patch_size": patch,
        "image_size": grid * patch,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-6,
    }
    text = {
        "vocab_size": vocabulary,
        "hidden_size": text_width,
        "intermediate_size": state[f"{TEXT}encoder.layer.0.intermediate.dense.weight"].shape[0],
        "num_hidden_layers": _layers(state, rf"{re.escape(TEXT)}encoder\.layer\.(\d+)\."),
        "num_attention_heads": text_width // HEAD_WIDTH,
        "max_position_embeddings": state[f"{TEXT}embeddings.position_embeddings.weight"].shape[0],
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
        "is_decoder": True,  # BlipTextLayer builds its cross-attention only so; the reward runs it bidirectionally
        "pad_token_id": 0,
        "bos_token_id": None,  # BLIP's decoder's tokens: nothing here generates text
        "eos_token_id": None,
        "sep_token_id": None,
    }
    return BlipConfig(
        text_config=text, vision_config=vision, image_text_hidden_size=state["blip.vision_proj.weight"].shape[0]
    )


def _vision_weights(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    ours = "vision_model."
    weights = {
        f"{ours}embeddings.class_embedding": state[f"{VISION}cls_token"],
        f"{ours}embeddings.patch_embedding.weight": state[f"{VISION}patch_embed.proj.weight"],
        f"{ours}embeddings.patch_embedding.bias": state[f"{VISION}patch_embed.proj.bias"],
        f"{ours}embeddings.position_embedding": state[f"{VISION}pos_embed"],
        f"{ours}post_layernorm.weight": state[f"{VISION}norm.weight"],
        f"{ours}post_layernorm.bias": state[f"{VISION}norm.bias"],
    }
    names = {
        "norm1": "layer_norm1",
        "attn.qkv": "self_attn.qkv",
        "attn.proj": "self_attn.projection",
        "norm2": "layer_norm2",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
    }
    for layer in range(layers):
        for theirs, name in names.items():
            for kind in ("weight", "bias"):
                weights[f"{ours}encoder.layers.{layer}.{name}.{kind}"] = state[
                    f"{VISION}blocks.{layer}.{theirs}.{kind}"
                ]
    return weights


def blip_model(state: dict[str, torch.Tensor]) -> BlipForImageTextRetrieval:
    """A transformers BlipForImageTextRetrieval computing what ImageReward's `blip` computes (fp32), its
    `itm_head` zero (ImageReward has none)."""
    config = blip_config(state)
    weights = _vision_weights(state, config.vision_config.num_hidden_layers)
    weights |= {f"text_encoder.{k.removeprefix(TEXT)}": v for k, v in state.items() if k.startswith(TEXT)}
    for projection in ("vision_proj", "text_proj"):
        weights |= {f"{projection}.{kind}": state[f"blip.{projection}.{kind}"] for kind in ("weight", "bias")}
    model = BlipForImageTextRetrieval(config).eval()
    with torch.no_grad():
        model.itm_head.weight.zero_()
        model.itm_head.bias.zero_()
    expected = {k for k in model.state_dict() if not k.endswith("position_ids") and not k.startswith("itm_head.")}
    if missing := sorted(expected - weights.keys()):
        raise ValueError(f"has no tensor for {missing[0]} of transformers' BlipForImageTextRetrieval")
    weights = {k: v for k, v in weights.items() if k in expected}  # med.py's position_ids buffer, a pooler
    model.load_state_dict({k: v.float().contiguous() for k, v in weights.items()}, strict=False)
    return model


def score_head(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward's MLP in upstream's names (`layers.N.weight` / `.bias`), fp32: what `rewards.models` reads."""
    head = {k.removeprefix("mlp."): v.float().contiguous() for k, v in state.items() if k.startswith("mlp.layers.")}
    if not head:
        raise ValueError("has no mlp.layers tensors (ImageReward's score head)")
    return head
