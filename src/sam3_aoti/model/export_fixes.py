"""What `transformers.Sam3Model` needs to export and AOT-compile: the DETR decoder's grid side as a Python int,
the DETR encoder's first layer split where the prompt comes in (its self-attention runs once per image), and
the masked attentions on SDPA with masks laid out as every kernel and AOTInductor take them. Each is swapped in
on the instance; the library's text stays untouched."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, Sam3Model
from transformers.models.sam3.modeling_sam3 import Sam3DetrDecoder, Sam3DetrEncoderLayer

from ..runtime import attention


class StaticShapeDetrDecoder(Sam3DetrDecoder):
    """Sam3DetrDecoder whose box-bias grid size is a Python int, not a tensor.

    transformers passes the feature height/width as tensors into `torch.arange`, which export turns into
    unbacked symbols (`GuardOnDataDependentSymNode: Eq(u0*u1, 64)`). SAM3 feeds the DETR one square level,
    so the side is known from the config (`static_side`)."""

    static_side: int

    def _get_rpb_matrix(self, reference_boxes, spatial_shape):
        return super()._get_rpb_matrix(reference_boxes, (self.static_side, self.static_side))


class PerPairDetrEncoderLayer(Sam3DetrEncoderLayer):
    """SAM3's first DETR encoder layer, split where the prompt comes in: its self-attention over the image
    tokens sees no prompt, so `self_attend` runs it once per image (in `encode_image`), and `forward` runs
    the rest (the cross-attention to the prompt and the MLP) once per (image, prompt) pair. The two halves
    are transformers' `Sam3DetrEncoderLayer.forward`, line for line."""

    def self_attend(self, level: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """`[B, C, H, W]` image features -> the same after the layer's self-attention (and its residual)."""
        batch, channels, height, width = level.shape
        tokens, position = level.flatten(2).transpose(1, 2), position.flatten(2).transpose(1, 2)
        hidden = self.layer_norm1(tokens)
        with_position = hidden + position
        attended, _ = self.self_attn(query=with_position, key=with_position, value=hidden)
        tokens = self.dropout(attended) + tokens
        return tokens.transpose(1, 2).reshape(batch, channels, height, width)

    def forward(self, vision_feats, prompt_feats, vision_pos_encoding, prompt_cross_attn_mask=None, **kwargs):
        residual = vision_feats
        hidden, _ = self.cross_attn(query=self.layer_norm2(vision_feats), key=prompt_feats, value=prompt_feats,
                                    attention_mask=prompt_cross_attn_mask, **kwargs)
        hidden = self.dropout(hidden) + residual
        return self.dropout(self.mlp(self.layer_norm3(hidden))) + hidden


def detr_side(config) -> int:
    """Side of the one feature level the DETR sees (image / patch, scale 1.0)."""
    vit = config.vision_config.backbone_config
    return vit.image_size // vit.patch_size


def fix_for_export(model: Sam3Model, masked_attention: str) -> None:
    """Swap in this module's classes and attention on `model`'s instances."""
    decoder = model.detr_decoder
    decoder.__class__ = StaticShapeDetrDecoder
    decoder.static_side = detr_side(model.config)
    model.detr_encoder.layers[0].__class__ = PerPairDetrEncoderLayer
    set_masked_attention(model, masked_attention)


MASKED_ATTENTION = ("text_encoder", "geometry_encoder", "detr_encoder", "detr_decoder", "mask_decoder")
DENSE_MASK_SDPA = "sam3_dense_mask_sdpa"


def dense_mask(mask: torch.Tensor, dtype: torch.dtype, query_len: int, key_len: int) -> torch.Tensor:
    """An attention mask as every SDPA kernel and AOTInductor take it: additive, in the query's dtype,
    materialized `[B, H|1, Lq, Lk]` with last stride 1 and rows padded to a multiple of 8 elements (the
    padding is sliced off again, so only the strides change). A broadcast or bool mask handed to the
    compiled memory-efficient kernel failed on the H200 with "(*bias): last dimension must be contiguous"."""
    if mask.dtype == torch.bool:  # True = attend (transformers' sdpa masks)
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return attention.aligned_rows(mask.to(dtype).expand(mask.shape[0], mask.shape[1], query_len, key_len))


def static_keys(key, value, attention_mask):
    """A key count export sees as dynamic (the exemplar boxes' geometry tokens attending to each other) padded to
    its static upper bound, rounded up to MASK_ROW_ALIGN, the padding masked out: the mask's last dimension is
    then a number, not `keys + -keys % 8`, which the memory-efficient kernel's own padding of an unaligned mask
    would make export guard on (it failed the tiny CUDA build). Masked keys weigh nothing."""
    keys = key.shape[2]
    pad = attention._aligned_bound(keys) - keys
    masked = False if attention_mask.dtype == torch.bool else torch.finfo(attention_mask.dtype).min
    attention_mask = F.pad(attention_mask.expand(*attention_mask.shape[:-1], keys), (0, pad), value=masked)
    return F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad)), attention_mask


def dense_mask_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface, on SDPA for masked attentions (`dense_mask` gives the layout).

    A causal attention (the CLIP text encoder) runs with `is_causal` and no mask: that is Meta's text
    encoder (a causal mask only; padding never reaches a real token, since tokens are right-padded and
    every later use of the text masks the padding), and it lets the flash and cuDNN kernels take it."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    dtype = getattr(module, "attention_dtype", query.dtype)  # set by `mixed_precision.attention_in`
    if not (causal or attention_mask is None or isinstance(key.shape[2], int)):
        key, value, attention_mask = static_keys(key, value, attention_mask)
    mask = None if causal or attention_mask is None else dense_mask(attention_mask, dtype, query.shape[2],
                                                                     key.shape[2])
    out = F.scaled_dot_product_attention(query.to(dtype), key.to(dtype), value.to(dtype), attn_mask=mask,
                                         scale=scaling, is_causal=causal and query.shape[2] > 1)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _register_dense_mask_sdpa() -> None:
    from transformers import AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(DENSE_MASK_SDPA, dense_mask_sdpa)
    AttentionMaskInterface.register(DENSE_MASK_SDPA, sdpa_mask)  # transformers builds bool masks, as for sdpa


def set_masked_attention(model: Sam3Model, implementation: str) -> None:
    """Where a mask or bias is added (text encoder, geometry encoder, DETR encoder cross-attention, DETR
    decoder, mask decoder): `"sdpa"` runs them through `dense_mask_sdpa`, `"eager"` as plain matmul-softmax.
    The ViT and the DETR encoder's self-attention over the 72x72 image tokens have no mask and keep
    transformers' SDPA. The switch is per sub-config because transformers builds each mask from the parent's
    config; the unmasked self-attentions then get a config of their own back on plain SDPA."""
    if implementation not in ("sdpa", "eager"):
        raise ValueError(f"masked attention {implementation!r}: use sdpa or eager")
    name = DENSE_MASK_SDPA if implementation == "sdpa" else "eager"
    if implementation == "sdpa":
        _register_dense_mask_sdpa()
    for part in MASKED_ATTENTION:
        for module in getattr(model, part).modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = name
    for layer in model.detr_encoder.layers:
        layer.self_attn.config = copy.copy(layer.self_attn.config)
        layer.self_attn.config._attn_implementation = "sdpa"
