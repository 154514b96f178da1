"""SAM3's configs (tiny for CPU builds, full as Meta builds it), seeded random init and example inputs."""

from __future__ import annotations

import torch
from transformers import Sam3Config, Sam3Model

from ..runtime.tokenizer import CONTEXT_LENGTH, END, START

# A SAM3 small enough to export and AOT-compile on 2 CPU cores in a minute or two.
TINY_CONFIG = {
    "vision_config": {
        "backbone_config": {
            "model_type": "sam3_vit_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "image_size": 112,
            "patch_size": 14,
            "window_size": 4,
            "global_attn_indexes": [1, 3],
            "pretrain_image_size": 112,
            "layer_norm_eps": 1e-5,  # Meta's ViT (see full_config)
        },
        "fpn_hidden_size": 32,
        "backbone_feature_sizes": [[32, 32], [16, 16], [8, 8]],
    },
    "text_config": {
        "model_type": "clip_text_model",
        "vocab_size": 49408,
        "max_position_embeddings": 32,
        "hidden_size": 64,
        "intermediate_size": 256,  # Meta's text encoder fixes mlp_ratio = 4
        "hidden_act": "gelu",  # as Sam3Config's (CLIPTextConfig's own default is quick_gelu)
        "projection_dim": 512,  # Meta's text encoder fixes output_dim = 512 (its pooled output is unused)
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    },
    "geometry_encoder_config": {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
    "detr_encoder_config": {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
    "detr_decoder_config": {
        "hidden_size": 32,
        "num_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "num_queries": 16,
    },
    "mask_decoder_config": {"hidden_size": 32, "num_attention_heads": 2},
}


def tiny_config() -> Sam3Config:
    return Sam3Config(**TINY_CONFIG)


def full_config() -> Sam3Config:
    """SAM3 as Meta builds it. transformers' default ViT LayerNorm eps is 1e-6; Meta's ViT uses
    nn.LayerNorm(eps=1e-5), and with it the vision features match Meta's to fp32 noise (2e-6 vs 3e-3)."""
    config = Sam3Config()
    config.vision_config.backbone_config.layer_norm_eps = 1e-5
    return config


def random_model(config: Sam3Config, seed: int, matrix_gain: float | None = None, bias_noise: float = 0.0) -> Sam3Model:
    """A seeded random-init model: the same seed gives the same weights on any machine.

    transformers' init leaves every bias at 0 and every norm weight at 1 (about 900 of SAM3's tensors), so
    same-shaped tensors are equal and a conversion table that swaps two of them passes every check; its
    std 0.02 also leaves a small model nearly deaf to its inputs. So seeded N(0, bias_noise) noise is added
    to every vector and constant tensor, and with `matrix_gain` every matrix is redrawn as
    N(0, gain^2 / fan_in), which keeps activations of order one through the layers."""
    torch.manual_seed(seed)
    model = Sam3Model(config).eval()
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if matrix_gain is not None and param.dim() >= 2:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=noise) * (matrix_gain / fan_in**0.5))
            elif bias_noise and (param.dim() < 2 or bool(param.min() == param.max())):
                param.add_(torch.randn(param.shape, generator=noise) * bias_noise)
    return model


def example_inputs(config: Sam3Config, batch: int, prompts: int, seed: int = 0, device="cpu"):
    """Random images and token ids of the right shapes (ids: start, a few words, end, zero padding)."""
    g = torch.Generator().manual_seed(seed)
    size = config.vision_config.backbone_config.image_size
    images = torch.randn(batch, 3, size, size, generator=g)
    ids = torch.zeros(prompts, CONTEXT_LENGTH, dtype=torch.long)
    for p in range(prompts):
        n = 1 + p % 5
        ids[p, 0] = START
        ids[p, 1 : 1 + n] = torch.randint(1, START, (n,), generator=g)
        ids[p, 1 + n] = END
    return images.to(device), ids.to(device)
