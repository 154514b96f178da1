"""Meta's own SAM3 (the `sam3` package) at any size, on the CPU: the reference the tests hold our package to.

Meta's `build_sam3_image_model` fixes the full architecture and wants CUDA; this builds the same modules,
with the same choices, at the sizes of a transformers `config.json` (so the tiny CI model has a Meta twin),
and loads a Meta-format `sam3.pt` into it, every tensor checked. Then it runs what Meta's own code runs:
Sam3Processor's image transform on raw images, and per prompt `forward_grounding` with the empty geometric
prompt (as Sam3Processor does for text prompts), with Meta's own tokenizer.

Runs in this folder's environment (torchvision, timm):
  uv run --project meta_sam3 python meta_sam3/meta_sam3.py REQUEST.pt RESULT.pt
REQUEST.pt: {"image_size": S, "images": [uint8 [3,H,W]], and for the model (else only the transform runs):
             "config": config.json as a dict, "checkpoint": path of sam3.pt, "bpe": CLIP's BPE vocabulary,
             "pixels": [[1,3,S,S] float], "prompts": [[str]]}
RESULT.pt:  {"pixels": [Meta's transform of each image], "outputs": [(logits, boxes, masks, presence) per
             pixels entry, one row per prompt]}
"""

import sys

import torch
from torch import nn


def build(config: dict, bpe: str):
    """Meta's Sam3Image, wired as model_builder.build_sam3_image_model wires it, at the config's sizes."""
    from sam3.model.decoder import TransformerDecoder, TransformerDecoderLayer
    from sam3.model.encoder import TransformerEncoderFusion, TransformerEncoderLayer
    from sam3.model.geometry_encoders import SequenceGeometryEncoder
    from sam3.model.maskformer_segmentation import PixelDecoder, UniversalSegmentationHead
    from sam3.model.model_misc import MLP, DotProductScoring, TransformerWrapper
    from sam3.model.model_misc import MultiheadAttentionWrapper as MultiheadAttention
    from sam3.model.necks import Sam3DualViTDetNeck
    from sam3.model.position_encoding import PositionEmbeddingSine
    from sam3.model.sam3_image import Sam3Image
    from sam3.model.text_encoder_ve import VETextEncoder
    from sam3.model.tokenizer_ve import SimpleTokenizer
    from sam3.model.vitdet import ViT
    from sam3.model.vl_combiner import SAM3VLBackbone

    vit, text = config["vision_config"]["backbone_config"], config["text_config"]
    enc, dec, geo = config["detr_encoder_config"], config["detr_decoder_config"], config["geometry_encoder_config"]
    d_model, mask = dec["hidden_size"], config["mask_decoder_config"]

    def attention(heads, batch_first=None, dropout=0.1):
        extra = {} if batch_first is None else {"batch_first": batch_first}
        return MultiheadAttention(num_heads=heads, dropout=dropout, embed_dim=d_model, **extra)

    def position_encoding():  # precompute_resolution=None: Meta precomputes on "cuda"; same values, lazily
        return PositionEmbeddingSine(num_pos_feats=d_model, normalize=True, scale=None, temperature=10000)

    trunk = ViT(img_size=vit["image_size"], pretrain_img_size=vit["pretrain_image_size"], patch_size=vit["patch_size"],
                embed_dim=vit["hidden_size"], depth=vit["num_hidden_layers"], num_heads=vit["num_attention_heads"],
                mlp_ratio=vit["intermediate_size"] / vit["hidden_size"], norm_layer="LayerNorm", drop_path_rate=0.1,
                qkv_bias=True, use_abs_pos=True, tile_abs_pos=True, global_att_blocks=tuple(vit["global_attn_indexes"]),
                rel_pos_blocks=(), use_rope=True, use_interp_rope=True, window_size=vit["window_size"],
                pretrain_use_cls_token=True, retain_cls_token=False, ln_pre=True, ln_post=False,
                return_interm_layers=False, bias_patch_embed=False)
    neck = Sam3DualViTDetNeck(position_encoding=position_encoding(), d_model=config["vision_config"]["fpn_hidden_size"],
                              scale_factors=config["vision_config"]["scale_factors"], trunk=trunk, add_sam2_neck=False)
    text_encoder = VETextEncoder(tokenizer=SimpleTokenizer(bpe_path=bpe), d_model=d_model, width=text["hidden_size"],
                                 heads=text["num_attention_heads"], layers=text["num_hidden_layers"],
                                 context_length=text["max_position_embeddings"], vocab_size=text["vocab_size"])
    backbone = SAM3VLBackbone(visual=neck, text=text_encoder, scalp=1)

    encoder = TransformerEncoderFusion(
        layer=TransformerEncoderLayer(
            activation="relu", d_model=d_model, dim_feedforward=enc["intermediate_size"], dropout=0.1,
            pos_enc_at_attn=True, pos_enc_at_cross_attn_keys=False, pos_enc_at_cross_attn_queries=False,
            pre_norm=True, self_attention=attention(enc["num_attention_heads"], batch_first=True),
            cross_attention=attention(enc["num_attention_heads"], batch_first=True)),
        num_layers=enc["num_layers"], d_model=d_model, num_feature_levels=1, frozen=False, use_act_checkpoint=True,
        add_pooled_text_to_img_feat=False, pool_text_with_mask=True)
    decoder = TransformerDecoder(
        layer=TransformerDecoderLayer(
            activation="relu", d_model=d_model, dim_feedforward=dec["intermediate_size"], dropout=0.1,
            cross_attention=attention(dec["num_attention_heads"]), n_heads=dec["num_attention_heads"],
            use_text_cross_attention=True),
        num_layers=dec["num_layers"], num_queries=dec["num_queries"], return_intermediate=True, box_refine=True,
        num_o2m_queries=0, dac=True, boxRPB="log", d_model=d_model, frozen=False, interaction_layer=None,
        dac_use_selfatt_ln=True, resolution=None, stride=None,  # None: the box-bias grid is built lazily, not on cuda
        use_act_checkpoint=True, presence_token=True)
    scoring = DotProductScoring(d_model=d_model, d_proj=d_model, prompt_mlp=MLP(
        input_dim=d_model, hidden_dim=dec["intermediate_size"], output_dim=d_model, num_layers=2, dropout=0.1,
        residual=True, out_norm=nn.LayerNorm(d_model)))
    segmentation = UniversalSegmentationHead(
        hidden_dim=mask["hidden_size"], upsampling_stages=mask["num_upsampling_stages"], aux_masks=False,
        presence_head=False, dot_product_scorer=None, act_ckpt=True,
        cross_attend_prompt=attention(mask["num_attention_heads"], dropout=0),
        pixel_decoder=PixelDecoder(num_upsampling_stages=mask["num_upsampling_stages"], interpolation_mode="nearest",
                                   hidden_dim=mask["hidden_size"]))
    geometry = SequenceGeometryEncoder(
        pos_enc=position_encoding(), encode_boxes_as_points=False, points_direct_project=True, points_pool=True,
        points_pos_enc=True, boxes_direct_project=True, boxes_pool=True, boxes_pos_enc=True, d_model=d_model,
        num_layers=geo["num_layers"], use_act_ckpt=True, add_cls=True, add_post_encode_proj=True,
        layer=TransformerEncoderLayer(
            activation="relu", d_model=d_model, dim_feedforward=geo["intermediate_size"], dropout=0.1,
            pos_enc_at_attn=False, pre_norm=True, pos_enc_at_cross_attn_queries=False, pos_enc_at_cross_attn_keys=True,
            self_attention=attention(geo["num_attention_heads"], batch_first=False),
            cross_attention=attention(geo["num_attention_heads"], batch_first=False)))
    return Sam3Image(backbone=backbone, transformer=TransformerWrapper(encoder=encoder, decoder=decoder, d_model=d_model),
                     input_geometry_encoder=geometry, segmentation_head=segmentation, num_feature_levels=1,
                     o2m_mask_predict=True, dot_prod_scoring=scoring, use_instance_query=False, multimask_output=True,
                     inst_interactive_predictor=None, matcher=None).eval()


# Meta keys its modules compute themselves (RoPE tables) or our checkpoint has no use for (point prompts).
COMPUTED = ("freqs_cis", "geometry_encoder.points_")


def load(model, checkpoint: str) -> None:
    """Meta's loading (`detector.` prefix dropped), but strict: every tensor present, shaped and taken."""
    state = {k.removeprefix("detector."): v for k, v in torch.load(checkpoint, weights_only=True)["model"].items()}
    own = model.state_dict()
    missing = [k for k in own if k not in state and not any(c in k for c in COMPUTED)]
    unexpected = [k for k in state if k not in own]
    shaped = [k for k in state if k in own and own[k].shape != state[k].shape]
    if missing or unexpected or shaped:
        sys.exit(f"checkpoint does not fit Meta's model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                 f"wrongly shaped {shaped[:3]}")
    model.load_state_dict(state, strict=False)


def grounding(model, pixels: torch.Tensor, prompts: list[str], boxes=None):
    """Meta's raw outputs for one image and each prompt (one row per prompt), as Sam3Processor computes them;
    with `boxes` ([K, 4] normalized cx, cy, w, h, and [K] labels, 1 positive), each appended to the geometric
    prompt as `Sam3Processor.add_geometric_prompt` appends it."""
    from sam3.model.data_misc import FindStage

    find = FindStage(img_ids=torch.tensor([0]), text_ids=torch.tensor([0]), input_boxes=None, input_boxes_mask=None,
                     input_boxes_label=None, input_points=None, input_points_mask=None)
    image = model.backbone.forward_image(pixels)
    rows = []
    for prompt in prompts:
        geometric = model._get_dummy_prompt()
        for box, label in zip(*boxes) if boxes is not None else ():
            geometric.append_boxes(box.float().view(1, 1, 4), torch.tensor([bool(label)]).view(1, 1))
        out = model.forward_grounding(backbone_out={**image, **model.backbone.forward_text([prompt], device="cpu")},
                                      find_input=find, geometric_prompt=geometric, find_target=None)
        rows.append((out["pred_logits"], out["pred_boxes"], out["pred_masks"], out["presence_logit_dec"]))
    return tuple(torch.cat(parts) for parts in zip(*rows))


def main() -> None:
    from sam3.model.sam3_image_processor import Sam3Processor

    request = torch.load(sys.argv[1], weights_only=False)
    if not torch.cuda.is_available():  # Meta's box encoder pins host memory for a copy to CUDA: no-op here
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    processor = Sam3Processor(None, resolution=request["image_size"], device="cpu")
    with torch.inference_mode():
        result = {"pixels": [processor.transform(image).unsqueeze(0) for image in request["images"]]}
        if "checkpoint" in request:
            model = build(request["config"], request["bpe"])
            load(model, request["checkpoint"])
            boxes = request.get("boxes") or [None] * len(request["prompts"])
            result["outputs"] = [grounding(model, pixels, prompts, case_boxes)
                                 for pixels, prompts, case_boxes in zip(request["pixels"], request["prompts"], boxes)]
    torch.save(result, sys.argv[2])


if __name__ == "__main__":
    main()
