"""The export wrapper: `transformers.Sam3Model` behind the production interface.

`model(images [B,3,S,S], token_ids [P,32])` -> (pred_logits [N,Q,1], pred_boxes [N,Q,4] cxcywh,
pred_masks [N,Q,M,M], presence_logit_dec [N,1]) with N = B*P and pair i = (image i // P, prompt i % P),
the conventions of Meta's SAM3 code. The vision encoder (and the DETR encoder's first self-attention, which
sees no prompt) runs once per image and the text encoder once per prompt; only the rest of the DETR and the
mask heads see all N pairs. Those are the wrapper's three steps, `encode_image`, `encode_text` and `decode`,
which `Part` exports alone for encode once / decode many, beside `encode_boxes` for exemplar boxes. The model is made exportable by `export_fixes`, given
its precision by `mixed_precision` and made fast by `optimizations`, in that order.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Sam3Model
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.sam3.modeling_sam3 import box_cxcywh_to_xyxy, inverse_sigmoid

from ..runtime.contract import FP32_IN_BF16, IMAGE_MEAN, IMAGE_STD
from .export_fixes import fix_for_export
from .mixed_precision import apply_precision
from .optimizations import optimize, part_submodules
from .optimizations.pixel_decoder_per_image import PerImageMaskDecoder
from .roi_align import roi_align

DECODE_IMAGE_INPUTS = 6  # the outputs of encode_image that decode reads (contract.DECODE_INPUTS): all but the last


class Sam3Grounding(nn.Module):
    """Flat, tensor-only signature around Sam3Model for export (see module docstring)."""

    def __init__(self, model: Sam3Model, dtype: torch.dtype = torch.float32, fp32_parts: tuple = FP32_IN_BF16,
                 masked_attention: str = "sdpa", box_path_attention: str = "fp32", box_path_linears: str = "fp32",
                 fp8_parts: tuple = (), optimizations: tuple = ()):
        super().__init__()
        apply_precision(model, dtype, fp32_parts, masked_attention, box_path_attention, box_path_linears, fp8_parts)
        fix_for_export(model, masked_attention)
        optimize(model, optimizations)
        self.dtype = dtype
        self.optimizations = tuple(optimizations)
        self.model = model

    @classmethod
    def at(cls, model: Sam3Model, precision, **options) -> "Sam3Grounding":
        """The wrapper as a `pipeline.precision.Precision` defines it: compute dtype, fp32 parts, fp8 parts."""
        return cls(model, getattr(torch, precision.dtype), precision.fp32_parts, fp8_parts=precision.fp8_parts,
                   **options)

    @classmethod
    def built_as(cls, model: Sam3Model, settings, optimizations=None) -> "Sam3Grounding":
        """The wrapper the export stage exports: the build's precision and `[export]` attention choices, and its
        optimizations unless `optimizations` names others."""
        opts = settings.stage("export")
        optimizations = settings.optimizations if optimizations is None else optimizations
        return cls.at(model, settings.spec, masked_attention=opts["masked_attention"],
                      box_path_attention=opts["box_path_attention"],
                      box_path_linears=opts["box_path_linears"], optimizations=tuple(optimizations)).eval()

    def forward(self, images: torch.Tensor, token_ids: torch.Tensor):
        return self.decode(*self.encode_image(images)[:DECODE_IMAGE_INPUTS], *self.encode_text(token_ids))

    def encode_image(self, images: torch.Tensor):
        """Per image, what the heads read of it: the two finer FPN levels (the mask decoder's; with
        `pixel_decoder_per_image`, their pixel-decoder convolutions, `PerImageMaskDecoder.laterals`), the DETR's
        level after the DETR encoder's first self-attention (which sees no prompt), the position encoding of
        that level, the no-box geometry prompt (it attends to the image only) and its mask (`decode` reads these
        six), and the DETR's level as the ViT left it, which `encode_boxes` pools exemplar boxes from."""
        vision = self.model.get_vision_features(pixel_values=images.to(self.dtype))
        level0, level1, level2 = vision.fpn_hidden_states[:-1]  # Sam3Model drops the coarsest level
        position = vision.fpn_position_encoding[-2]
        attended = self.model.detr_encoder.layers[0].self_attend(level2, position)
        if self.per_image_laterals:  # the mask decoder's per-image convolutions of them, once per image
            level0, level1 = self.model.mask_decoder.laterals(level0, level1)
        geometry = self.empty_geometry_prompt(vision)
        geometry_mask = torch.ones(geometry.shape[:2], dtype=torch.long, device=geometry.device)
        return level0, level1, attended, position, geometry, geometry_mask, level2

    @property
    def per_image_laterals(self) -> bool:
        """`pixel_decoder_per_image`: the finer levels go to the heads as their convolutions (a part's pruned
        model may hold no mask decoder: `Part`)."""
        return isinstance(self.model._modules.get("mask_decoder"), PerImageMaskDecoder)

    def encode_text(self, token_ids: torch.Tensor):
        """Per prompt: the text encoder's token features and their mask (`token_ids != 0`)."""
        attention_mask = (token_ids != 0).long()
        text = self.model.get_text_features(input_ids=token_ids, attention_mask=attention_mask)
        return text.pooler_output, attention_mask

    def with_boxes(self, images, token_ids, boxes, labels):
        """`forward` with exemplar boxes on each image: the composition the package's parts compute."""
        features = self.encode_image(images)
        geometry = self.encode_boxes(features[-1], features[3], boxes, labels)
        return self.decode(*features[:DECODE_IMAGE_INPUTS - 2], *geometry, *self.encode_text(token_ids))

    def encode_boxes(self, level2, position, boxes, labels):
        """Exemplar boxes on encoded images: `boxes [B, K, 4]` (normalized cx, cy, w, h), `labels [B, K]` (1
        positive, 0 negative, -10 padding, as transformers' `input_boxes_labels`) -> the geometry prompt
        `[B, K + 1, C]` and its mask `[B, K + 1]` (padding 0), which `decode` takes in place of `encode_image`'s
        no-box prompt. transformers' `Sam3GeometryEncoder` step by step, its torchvision ROI align as
        `roi_align`; the CLS token comes after every box, padding included (transformers packs it after the
        valid ones: attention and pooling ignore the order). Boxes from one image's features may be decoded
        with other images: nothing here ties them to the image they were drawn on but the pooled features."""
        encoder = self.model.geometry_encoder
        batch, count = boxes.shape[:2]
        valid = labels != -10
        dtype, boxes = level2.dtype, boxes.float()  # coordinates stay fp32 (bf16 would move a box by 1/256)
        normalized = encoder.vision_layer_norm(level2.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        height, width = level2.shape[-2:]
        x0, y0, x1, y1 = box_cxcywh_to_xyxy(boxes).unbind(-1)  # scaled by Python ints: a tensor of the sizes
        corners = torch.stack([x0 * width, y0 * height, x1 * width, y1 * height], -1)  # would be a stored constant
        pooled = roi_align(normalized, corners, encoder.roi_size).flatten(0, 1)
        embedded = (encoder.boxes_direct_project(boxes.to(dtype))
                    + encoder.boxes_pool_project(pooled).view(batch, count, -1))
        center_x, center_y, box_width, box_height = boxes.unbind(-1)
        position_code = encoder._encode_box_coordinates(center_x.flatten(), center_y.flatten(), box_width.flatten(),
                                                        box_height.flatten())
        embedded = embedded + encoder.boxes_pos_enc_project(position_code.view(batch, count, -1).to(dtype))
        embedded = encoder.label_embed(torch.where(valid, labels, 0).long()) + embedded
        cls = encoder.cls_embed.weight.view(1, 1, -1).expand(batch, 1, -1)
        prompt = encoder.prompt_layer_norm(encoder.final_proj(torch.cat([embedded, cls.to(embedded.dtype)], 1)))
        mask = torch.cat([valid.long(), valid.new_ones(batch, 1).long()], 1)
        attention_mask = create_bidirectional_mask(config=encoder.config, inputs_embeds=prompt, attention_mask=mask)
        feats, pos = level2.flatten(2).transpose(1, 2), position.flatten(2).transpose(1, 2)
        for layer in encoder.layers:
            prompt = layer(prompt_feats=prompt, vision_feats=feats, vision_pos_encoding=pos, prompt_mask=attention_mask)
        return encoder.output_layer_norm(prompt), mask

    def decode(self, level0, level1, attended, position, geometry, geometry_mask, text_features, attention_mask):
        """The heads over every (image, prompt) pair of encoded images and encoded prompts: what
        `Sam3Model.forward` runs after its encoders for a text prompt, with the boxes and scores of the last
        decoder layer only (the model's outputs; Sam3Model scores all six and keeps the last)."""
        model, batch, prompts = self.model, level0.shape[0], text_features.shape[0]

        def pairs(image_tensor):  # pair i = (image i // P, prompt i % P)
            return image_tensor.repeat_interleave(prompts, dim=0)

        prompt = torch.cat([text_features.repeat(batch, 1, 1), pairs(geometry)], dim=1)
        prompt_mask = torch.cat([attention_mask.repeat(batch, 1), pairs(geometry_mask)], dim=1).bool()
        encoded = model.detr_encoder(vision_features=[pairs(attended)], text_features=prompt,
                                     vision_pos_embeds=[pairs(position)], text_mask=prompt_mask)
        decoded = model.detr_decoder(vision_features=encoded.last_hidden_state, text_features=prompt,
                                     vision_pos_encoding=encoded.pos_embeds_flattened, text_mask=prompt_mask,
                                     spatial_shapes=encoded.spatial_shapes)
        queries = decoded.intermediate_hidden_states[-1]
        offsets = model.detr_decoder.box_head(queries)
        boxes_cxcywh = (inverse_sigmoid(decoded.reference_boxes[-1]) + offsets).sigmoid()
        logits = model.dot_product_scoring(decoder_hidden_states=queries[None], text_features=prompt,
                                           text_mask=prompt_mask)[0]
        # the mask decoder reads only the shape of its last level: the DETR encoder's output takes its place
        if self.per_image_laterals:  # level0 and level1 are their laterals
            levels, per_image = [level0, level1, attended], {"pairs_per_image": prompts}
        else:
            levels, per_image = [pairs(level0), pairs(level1), attended], {}
        masks = model.mask_decoder(decoder_queries=queries, backbone_features=levels,
                                   encoder_hidden_states=encoded.last_hidden_state, prompt_features=prompt,
                                   prompt_mask=prompt_mask, **per_image).pred_masks
        outputs = (logits, boxes_cxcywh, masks, decoded.presence_logits[-1])
        return tuple(o.float() for o in outputs)

    def empty_geometry_prompt(self, vision) -> torch.Tensor:
        """The geometry encoder's output for no boxes, `[B, 1, C]`: its CLS token after attending to the image.

        Meta's SAM3 always appends this token to the text prompt (text-only grounding encodes an empty
        geometric prompt); transformers' Sam3Model skips the geometry encoder when no boxes are given,
        which moves every head's output (logits by ~1e-2 on random weights). This is the encoder's own
        no-box path (no box to pool: `encode_boxes` is the path with boxes)."""
        encoder = self.model.geometry_encoder
        feats, pos = vision.fpn_hidden_states[-2], vision.fpn_position_encoding[-2]  # the level it attends to
        cls = encoder.cls_embed.weight.view(1, 1, -1).expand(feats.shape[0], 1, -1)
        prompt = encoder.prompt_layer_norm(encoder.final_proj(cls))
        feats, pos = feats.flatten(2).transpose(1, 2), pos.flatten(2).transpose(1, 2)
        for layer in encoder.layers:
            prompt = layer(prompt_feats=prompt, vision_feats=feats, vision_pos_encoding=pos, prompt_mask=None)
        return encoder.output_layer_norm(prompt)


# `model` = decode(*encode_image(images), *encode_text(token_ids)); each part and the Sam3Model submodules it reads
# (and those an optimization adds: `optimizations.part_submodules`)
PARTS = {
    "encode_image": ("vision_encoder", "geometry_encoder", "detr_encoder.layers.0"),
    "encode_text": ("text_encoder", "text_projection"),
    "encode_boxes": ("geometry_encoder",),
    "decode": ("detr_encoder", "detr_decoder", "mask_decoder", "dot_product_scoring"),
}


def _pruned(module: nn.Module, paths) -> nn.Module:
    """A shallow copy of `module` holding only the submodules at the dotted `paths` (and what is above them),
    under the same names and as the same objects."""
    below: dict[str, list[str]] = {}
    for path in paths:
        head, _, rest = path.partition(".")
        below.setdefault(head, []).append(rest)
    view = copy.copy(module)
    view._modules = {name: module._modules[name] if "" in rests else _pruned(module._modules[name], rests)
                     for name, rests in below.items()}
    return view


class Part(nn.Module):
    """One part of `Sam3Grounding` as a module of its own, for export: a shallow copy of the grounding whose
    model holds only the submodules the part reads (any other would fail the export by name). Its weights
    are the grounding's own tensors under the same names, so a package stores them once."""

    def __init__(self, grounding: Sam3Grounding, name: str):
        super().__init__()
        model = _pruned(grounding.model, PARTS[name] + part_submodules(grounding.optimizations, name))
        view = copy.copy(grounding)
        view._modules = {"model": model}
        self.model = model
        self.part = getattr(view, name)  # bound to the view, which is no submodule of this one

    def forward(self, *args):
        return self.part(*args)


class ImageTransforms(nn.Module):
    """Any `[B,3,H,W]` float image batch in [0, 255] -> the model's `[B,3,S,S]` normalized input.

    Meta's Sam3Processor resizes the uint8 image and keeps it uint8 (torchvision v2: bilinear, antialias,
    then round to whole levels on the GPU), and only then scales to [0, 1]: the same steps here, so the
    pixels the model sees are Meta's (tests/test_meta_parity.py measures it)."""

    def __init__(self, image_size: int):
        super().__init__()
        self.image_size = image_size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(images, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False,
                          antialias=True)
        x = x.round().clamp(0, 255) / 255.0
        return (x - IMAGE_MEAN) / IMAGE_STD
