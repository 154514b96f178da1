"""`decoder_shared_projections`: the keys and values every DETR decoder layer projects from the same image
tokens and prompt as four stacked GEMMs for all layers, before the layers; each self-attention's query and
key projections as one GEMM (they read the same input); the presence row never padded onto a bias the
attention reads as tables; the presence logit and the intermediates of the last layer only (the `[-1]` that
`decode` reads). Measured in benchmarks/README.md."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.sam3.modeling_sam3 import (
    Sam3DetrDecoder,
    Sam3DetrDecoderLayer,
    Sam3DETRDecoderOutput,
    inverse_sigmoid,
)

from .grid_bias_attention import BiasTablesDecoder
from .layers import ProjectedAttention, extend, stack_linears
from .registry import register


class SharedProjectionsDecoder:
    """A DETR decoder mixin: transformers' `Sam3DetrDecoder.forward` on keys and values projected once for all
    layers; otherwise its loop, line for line, with the box refinement of the last layer left to `decode`."""

    def forward(self, vision_features, text_features, vision_pos_encoding, text_mask=None, spatial_shapes=None,
                **kwargs):
        batch = vision_features.shape[0]
        reference_boxes = self.reference_points.weight.unsqueeze(0).expand(batch, -1, -1).sigmoid()
        hidden = torch.cat([self.presence_token.weight.unsqueeze(0).expand(batch, -1, -1),
                            self.query_embed.weight.unsqueeze(0).expand(batch, -1, -1)], dim=1)
        text_attention_mask = None if text_mask is None else create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=text_mask, encoder_hidden_states=text_features)
        layers = len(self.layers)
        text_keys = self.text_keys(text_features).chunk(layers, -1)
        text_values = self.text_values(text_features).chunk(layers, -1)
        vision_keys = self.vision_keys(vision_features + vision_pos_encoding).chunk(layers, -1)
        vision_values = self.vision_values(vision_features).chunk(layers, -1)
        for i, layer in enumerate(self.layers):
            query_pos = self.ref_point_head(self.position_encoding.encode_boxes(reference_boxes))
            bias = self._get_rpb_matrix(reference_boxes, None)
            if not isinstance(self, BiasTablesDecoder):  # the presence row: it attends to every image token alike
                bias = F.pad(bias, (0, 0, 1, 0), mode="constant", value=0)
            hidden = layer(hidden, query_pos, (text_keys[i], text_values[i]), text_attention_mask,
                           (vision_keys[i], vision_values[i]), bias)
            queries = self.output_layer_norm(hidden[:, 1:])
            if i < layers - 1:
                reference_boxes = (self.box_head(queries) + inverse_sigmoid(reference_boxes)).sigmoid()
        presence = self.presence_head(self.presence_layer_norm(hidden[:, :1])).squeeze(-1)
        presence = presence.clamp(min=-self.clamp_presence_logit_max_val, max=self.clamp_presence_logit_max_val)
        return Sam3DETRDecoderOutput(intermediate_hidden_states=queries[None], reference_boxes=reference_boxes[None],
                                     presence_logits=presence[None])


class SharedProjectionsDecoderLayer(Sam3DetrDecoderLayer):
    """transformers' `Sam3DetrDecoderLayer.forward` on keys and values projected before the layers, its
    self-attention's query and key projections as one GEMM (`qk_proj`). Dropout is left out: the wrapper runs in
    eval mode, where it is the identity."""

    def forward(self, hidden, query_pos, text_kv, text_mask, vision_kv, vision_bias):
        dtype = hidden.dtype
        query_pos = F.pad(query_pos, (0, 0, 1, 0), mode="constant", value=0)  # the presence token's: none
        with_position = hidden + query_pos
        query, key = self.self_attn.qk_proj(with_position).chunk(2, dim=-1)
        out, _ = self.self_attn.attend(query, key, self.self_attn.v_proj(hidden), None, dtype)
        hidden = self.self_attn_layer_norm(hidden + out)
        out, _ = self.text_cross_attn.attend(self.text_cross_attn.q_proj(hidden + query_pos), *text_kv, text_mask,
                                             dtype)
        hidden = self.text_cross_attn_layer_norm(hidden + out)
        out, _ = self.vision_cross_attn.attend(self.vision_cross_attn.q_proj(hidden + query_pos), *vision_kv,
                                               vision_bias, dtype)
        hidden = self.vision_cross_attn_layer_norm(hidden + out)
        return self.mlp_layer_norm(hidden + self.mlp(hidden))


def share_decoder_projections(decoder: Sam3DetrDecoder) -> None:
    """The text and image keys and values of every layer as four stacked GEMMs on the decoder, each
    self-attention's query and key projections as one; the layers' own go."""
    layers = decoder.layers
    for name, attention_name, projection in (("text_keys", "text_cross_attn", "k_proj"),
                                             ("text_values", "text_cross_attn", "v_proj"),
                                             ("vision_keys", "vision_cross_attn", "k_proj"),
                                             ("vision_values", "vision_cross_attn", "v_proj")):
        modules = [getattr(layer, attention_name) for layer in layers]
        setattr(decoder, name, stack_linears([getattr(module, projection) for module in modules]))
        for module in modules:
            delattr(module, projection)
    for layer in layers:
        attention_module = layer.self_attn
        attention_module.qk_proj = stack_linears([attention_module.q_proj, attention_module.k_proj])
        del attention_module.q_proj, attention_module.k_proj
        for module in (layer.self_attn, layer.text_cross_attn, layer.vision_cross_attn):
            if not isinstance(module, ProjectedAttention):  # `grid_bias_attention`'s is one already
                module.__class__ = ProjectedAttention
        layer.__class__ = SharedProjectionsDecoderLayer
    extend(decoder, SharedProjectionsDecoder)


# After grid_bias_attention: it keeps that optimization's attention class on the vision cross-attentions.
@register("decoder_shared_projections", after=("grid_bias_attention",))
def apply(model: nn.Module) -> None:
    share_decoder_projections(model.detr_decoder)
