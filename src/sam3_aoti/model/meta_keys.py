"""Meta's original checkpoint (`sam3.pt`) <-> transformers' `Sam3Model` state dict.

`KEY_MAP` is the one table of where each Meta parameter lives in transformers' model (after
transformers' own `convert_sam3_to_hf.py`, checked key by key and shape by shape against the model
Meta's `sam3` 0.1.4 builds, see tests/data). Beyond renaming, three kinds of values change form:
fused q/k/v projections are split, the ViT position table loses its unused cls row, and CLIP's text
projection is stored transposed. `to_meta` is the inverse, for tests and the parity check.
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..errors import WeightsError

# (Meta prefix without "detector.", transformers prefix). `{n}` is a layer index. The longest matching
# Meta prefix wins, so a rule for `x.out_proj.` beats one for `x.`. Names equal on both sides map to
# themselves through the short catch-all rules at the end of each block.
KEY_MAP: list[tuple[str, str]] = [
    # Vision: ViT trunk
    ("backbone.vision_backbone.trunk.pos_embed", "vision_encoder.backbone.embeddings.position_embeddings"),
    ("backbone.vision_backbone.trunk.patch_embed.proj.", "vision_encoder.backbone.embeddings.patch_embeddings.projection."),
    ("backbone.vision_backbone.trunk.ln_pre.", "vision_encoder.backbone.layer_norm."),
    ("backbone.vision_backbone.trunk.blocks.{n}.norm1.", "vision_encoder.backbone.layers.{n}.layer_norm1."),
    ("backbone.vision_backbone.trunk.blocks.{n}.norm2.", "vision_encoder.backbone.layers.{n}.layer_norm2."),
    ("backbone.vision_backbone.trunk.blocks.{n}.attn.qkv.", "vision_encoder.backbone.layers.{n}.attention.qkv."),
    ("backbone.vision_backbone.trunk.blocks.{n}.attn.proj.", "vision_encoder.backbone.layers.{n}.attention.o_proj."),
    ("backbone.vision_backbone.trunk.blocks.{n}.mlp.", "vision_encoder.backbone.layers.{n}.mlp."),
    # Vision: FPN neck (level 0 upsamples 4x in two steps, level 1 2x, level 3 max-pools: no weights)
    ("backbone.vision_backbone.convs.{n}.dconv_2x2_0.", "vision_encoder.neck.fpn_layers.{n}.scale_layers.0."),
    ("backbone.vision_backbone.convs.{n}.dconv_2x2_1.", "vision_encoder.neck.fpn_layers.{n}.scale_layers.2."),
    ("backbone.vision_backbone.convs.{n}.dconv_2x2.", "vision_encoder.neck.fpn_layers.{n}.scale_layers.0."),
    ("backbone.vision_backbone.convs.{n}.conv_1x1.", "vision_encoder.neck.fpn_layers.{n}.proj1."),
    ("backbone.vision_backbone.convs.{n}.conv_3x3.", "vision_encoder.neck.fpn_layers.{n}.proj2."),
    # Text: CLIP encoder and the 1024 -> 256 resizer
    ("backbone.language_backbone.encoder.token_embedding.", "text_encoder.text_model.embeddings.token_embedding."),
    ("backbone.language_backbone.encoder.positional_embedding", "text_encoder.text_model.embeddings.position_embedding.weight"),
    ("backbone.language_backbone.encoder.ln_final.", "text_encoder.text_model.final_layer_norm."),
    ("backbone.language_backbone.encoder.text_projection", "text_encoder.text_projection.weight"),
    ("backbone.language_backbone.encoder.transformer.resblocks.{n}.attn.", "text_encoder.text_model.encoder.layers.{n}.self_attn."),
    ("backbone.language_backbone.encoder.transformer.resblocks.{n}.ln_1.", "text_encoder.text_model.encoder.layers.{n}.layer_norm1."),
    ("backbone.language_backbone.encoder.transformer.resblocks.{n}.ln_2.", "text_encoder.text_model.encoder.layers.{n}.layer_norm2."),
    ("backbone.language_backbone.encoder.transformer.resblocks.{n}.mlp.c_fc.", "text_encoder.text_model.encoder.layers.{n}.mlp.fc1."),
    ("backbone.language_backbone.encoder.transformer.resblocks.{n}.mlp.c_proj.", "text_encoder.text_model.encoder.layers.{n}.mlp.fc2."),
    ("backbone.language_backbone.resizer.", "text_projection."),
    # Geometry (box prompt) encoder
    ("geometry_encoder.", "geometry_encoder."),
    ("geometry_encoder.encode.{n}.cross_attn_image.out_proj.", "geometry_encoder.layers.{n}.cross_attn.o_proj."),
    ("geometry_encoder.encode.{n}.cross_attn_image.", "geometry_encoder.layers.{n}.cross_attn."),
    ("geometry_encoder.encode.{n}.self_attn.out_proj.", "geometry_encoder.layers.{n}.self_attn.o_proj."),
    ("geometry_encoder.encode.{n}.self_attn.", "geometry_encoder.layers.{n}.self_attn."),
    ("geometry_encoder.encode.{n}.linear1.", "geometry_encoder.layers.{n}.mlp.fc1."),
    ("geometry_encoder.encode.{n}.linear2.", "geometry_encoder.layers.{n}.mlp.fc2."),
    ("geometry_encoder.encode.{n}.norm1.", "geometry_encoder.layers.{n}.layer_norm1."),
    ("geometry_encoder.encode.{n}.norm2.", "geometry_encoder.layers.{n}.layer_norm2."),
    ("geometry_encoder.encode.{n}.norm3.", "geometry_encoder.layers.{n}.layer_norm3."),
    ("geometry_encoder.img_pre_norm.", "geometry_encoder.vision_layer_norm."),
    ("geometry_encoder.norm.", "geometry_encoder.prompt_layer_norm."),
    ("geometry_encoder.encode_norm.", "geometry_encoder.output_layer_norm."),
    # DETR encoder
    ("transformer.encoder.layers.{n}.cross_attn_image.out_proj.", "detr_encoder.layers.{n}.cross_attn.o_proj."),
    ("transformer.encoder.layers.{n}.cross_attn_image.", "detr_encoder.layers.{n}.cross_attn."),
    ("transformer.encoder.layers.{n}.self_attn.out_proj.", "detr_encoder.layers.{n}.self_attn.o_proj."),
    ("transformer.encoder.layers.{n}.self_attn.", "detr_encoder.layers.{n}.self_attn."),
    ("transformer.encoder.layers.{n}.linear1.", "detr_encoder.layers.{n}.mlp.fc1."),
    ("transformer.encoder.layers.{n}.linear2.", "detr_encoder.layers.{n}.mlp.fc2."),
    ("transformer.encoder.layers.{n}.norm1.", "detr_encoder.layers.{n}.layer_norm1."),
    ("transformer.encoder.layers.{n}.norm2.", "detr_encoder.layers.{n}.layer_norm2."),
    ("transformer.encoder.layers.{n}.norm3.", "detr_encoder.layers.{n}.layer_norm3."),
    # DETR decoder
    ("transformer.decoder.", "detr_decoder."),
    ("transformer.decoder.presence_token_head.layers.0.", "detr_decoder.presence_head.layer1."),
    ("transformer.decoder.presence_token_head.layers.1.", "detr_decoder.presence_head.layer2."),
    ("transformer.decoder.presence_token_head.layers.2.", "detr_decoder.presence_head.layer3."),
    ("transformer.decoder.presence_token_out_norm.", "detr_decoder.presence_layer_norm."),
    ("transformer.decoder.norm.", "detr_decoder.output_layer_norm."),
    ("transformer.decoder.bbox_embed.layers.0.", "detr_decoder.box_head.layer1."),
    ("transformer.decoder.bbox_embed.layers.1.", "detr_decoder.box_head.layer2."),
    ("transformer.decoder.bbox_embed.layers.2.", "detr_decoder.box_head.layer3."),
    ("transformer.decoder.ref_point_head.layers.0.", "detr_decoder.ref_point_head.layer1."),
    ("transformer.decoder.ref_point_head.layers.1.", "detr_decoder.ref_point_head.layer2."),
    ("transformer.decoder.boxRPB_embed_x.layers.0.", "detr_decoder.box_rpb_embed_x.layer1."),
    ("transformer.decoder.boxRPB_embed_x.layers.1.", "detr_decoder.box_rpb_embed_x.layer2."),
    ("transformer.decoder.boxRPB_embed_y.layers.0.", "detr_decoder.box_rpb_embed_y.layer1."),
    ("transformer.decoder.boxRPB_embed_y.layers.1.", "detr_decoder.box_rpb_embed_y.layer2."),
    ("transformer.decoder.layers.{n}.self_attn.out_proj.", "detr_decoder.layers.{n}.self_attn.o_proj."),
    ("transformer.decoder.layers.{n}.self_attn.", "detr_decoder.layers.{n}.self_attn."),
    ("transformer.decoder.layers.{n}.ca_text.out_proj.", "detr_decoder.layers.{n}.text_cross_attn.o_proj."),
    ("transformer.decoder.layers.{n}.ca_text.", "detr_decoder.layers.{n}.text_cross_attn."),
    ("transformer.decoder.layers.{n}.cross_attn.out_proj.", "detr_decoder.layers.{n}.vision_cross_attn.o_proj."),
    ("transformer.decoder.layers.{n}.cross_attn.", "detr_decoder.layers.{n}.vision_cross_attn."),
    ("transformer.decoder.layers.{n}.linear1.", "detr_decoder.layers.{n}.mlp.fc1."),
    ("transformer.decoder.layers.{n}.linear2.", "detr_decoder.layers.{n}.mlp.fc2."),
    ("transformer.decoder.layers.{n}.norm1.", "detr_decoder.layers.{n}.vision_cross_attn_layer_norm."),
    ("transformer.decoder.layers.{n}.catext_norm.", "detr_decoder.layers.{n}.text_cross_attn_layer_norm."),
    ("transformer.decoder.layers.{n}.norm2.", "detr_decoder.layers.{n}.self_attn_layer_norm."),
    ("transformer.decoder.layers.{n}.norm3.", "detr_decoder.layers.{n}.mlp_layer_norm."),
    # Query/prompt dot-product scoring
    ("dot_prod_scoring.prompt_mlp.layers.0.", "dot_product_scoring.text_mlp.layer1."),
    ("dot_prod_scoring.prompt_mlp.layers.1.", "dot_product_scoring.text_mlp.layer2."),
    ("dot_prod_scoring.prompt_mlp.out_norm.", "dot_product_scoring.text_mlp_out_norm."),
    ("dot_prod_scoring.prompt_proj.", "dot_product_scoring.text_proj."),
    ("dot_prod_scoring.hs_proj.", "dot_product_scoring.query_proj."),
    # Mask decoder
    ("segmentation_head.pixel_decoder.", "mask_decoder.pixel_decoder."),
    ("segmentation_head.mask_predictor.mask_embed.", "mask_decoder.mask_embedder."),
    ("segmentation_head.instance_seg_head.", "mask_decoder.instance_projection."),
    ("segmentation_head.semantic_seg_head.", "mask_decoder.semantic_projection."),
    ("segmentation_head.cross_attend_prompt.out_proj.", "mask_decoder.prompt_cross_attn.o_proj."),
    ("segmentation_head.cross_attend_prompt.", "mask_decoder.prompt_cross_attn."),
    ("segmentation_head.cross_attn_norm.", "mask_decoder.prompt_cross_attn_norm."),
]

# Meta keys with no place in transformers' text-grounding Sam3Model, left out on purpose.
DROPPED: list[tuple[str, str]] = [
    ("tracker.", "the video tracker (transformers' Sam3TrackerModel, not this package)"),
    ("backbone.vision_backbone.sam2_convs.", "the SAM2-style neck of Meta's interactive predictor"),
    ("backbone.vision_backbone.trunk.blocks.{n}.attn.freqs_cis", "RoPE tables transformers computes itself"),
    ("geometry_encoder.points_", "point-prompt projections (Sam3Model takes text and boxes)"),
]

META_PREFIX = "detector."
FUSED_QKV = (".qkv.", ".in_proj_")  # transformers-side names right after renaming, before the split
POSITION_TABLE = "vision_encoder.backbone.embeddings.position_embeddings"
TEXT_PROJECTION = "text_encoder.text_projection.weight"


def _pattern(prefix: str) -> re.Pattern:
    return re.compile("^" + re.escape(prefix).replace(r"\{n\}", r"(?P<n>\d+)"))


@lru_cache(maxsize=2)
def _rules(inverse: bool) -> list[tuple[re.Pattern, str, int]]:
    """(pattern on the source side, target prefix, specificity), most specific first."""
    pairs = [(hf, meta) if inverse else (meta, hf) for meta, hf in KEY_MAP]
    rules = [(_pattern(src), dst, len(src)) for src, dst in pairs]
    return sorted(rules, key=lambda r: -r[2])


def _rename(key: str, inverse: bool) -> str | None:
    for pattern, target, _ in _rules(inverse):
        match = pattern.match(key)
        if match:
            return target.format(**match.groupdict()) + key[match.end():]
    return None


def _dropped(key: str) -> bool:
    return any(_pattern(prefix).match(key) for prefix, _ in DROPPED)


def meta_state_dict(checkpoint: dict) -> dict:
    """The detector's parameters from a loaded `sam3.pt` (`{"model": ...}` or a bare state dict)."""
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not state:
        raise WeightsError("the .pt file holds no state dict: expected Meta's sam3.pt ({'model': {name: tensor}})")
    return state


def to_transformers(state: dict) -> tuple[dict, list[str]]:
    """Meta names and layouts -> transformers'. Returns the new state dict and the Meta keys no rule
    covers (the caller reports them; nothing is dropped silently)."""
    import torch

    converted, unknown = {}, []
    for key, value in state.items():
        name = key[len(META_PREFIX):] if key.startswith(META_PREFIX) else key
        if _dropped(name):
            continue
        new = _rename(name, inverse=False)
        if new is None:
            unknown.append(key)
            continue
        if new == POSITION_TABLE:
            value = value[:, 1:]  # the cls token's row: Meta's ViT runs without a cls token
        elif new == TEXT_PROJECTION:
            value = value.T.contiguous()
        if any(f in new for f in FUSED_QKV):
            for part, chunk in zip("qkv", torch.chunk(value, 3, dim=0)):
                converted[_split_name(new, part)] = chunk.contiguous()
        else:
            converted[new] = value
    return converted, unknown


def _split_name(name: str, part: str) -> str:
    if ".qkv." in name:
        return name.replace(".qkv.", f".{part}_proj.")
    return name.replace(".in_proj_weight", f".{part}_proj.weight").replace(".in_proj_bias", f".{part}_proj.bias")


def to_meta(state: dict) -> dict:
    """transformers' names and layouts -> Meta's `sam3.pt` state dict (the inverse of `to_transformers`).
    What Meta computes itself or transformers lacks (`DROPPED`) is not produced."""
    import torch

    renamed: dict = {}
    fused: dict[str, dict] = {}
    for key, value in state.items():
        match = re.match(r"^(.*)\.([qkv])_proj\.(weight|bias)$", key)
        if match:
            base, part, kind = match.groups()
            name = f"{base}.qkv.{kind}" if base.startswith("vision_encoder.") else f"{base}.in_proj_{kind}"
            fused.setdefault(name, {})[part] = value
            continue
        if key == POSITION_TABLE:
            value = torch.cat([torch.zeros_like(value[:, :1]), value], dim=1)
        elif key == TEXT_PROJECTION:
            value = value.T.contiguous()
        renamed[_meta_name(key)] = value
    for name, parts in fused.items():
        renamed[_meta_name(name)] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    out = {}
    for key, value in renamed.items():
        # The inverse sends every `scale_layers.0` to `dconv_2x2_0`; one-step levels call it `dconv_2x2`.
        if ".dconv_2x2_0." in key and key.replace("_2x2_0.", "_2x2_1.") not in renamed:
            key = key.replace(".dconv_2x2_0.", ".dconv_2x2.")
        out[META_PREFIX + key] = value
    return out


def _meta_name(hf_key: str) -> str:
    name = _rename(hf_key, inverse=True)
    if name is None:
        raise WeightsError(f"no Meta name for {hf_key}: add a rule to KEY_MAP in model/meta_keys.py")
    return name
