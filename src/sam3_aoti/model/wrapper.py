"""The export wrapper: `transformers.Sam3Model` behind the production interface.

`model(images [B,3,S,S], token_ids [P,32])` -> (pred_logits [N,Q,1], pred_boxes [N,Q,4] cxcywh,
pred_masks [N,Q,M,M], presence_logit_dec [N,1]) with N = B*P and pair i = (image i // P, prompt i % P),
the conventions of Meta's SAM3 code. The vision encoder (and the DETR encoder's first self-attention, which
sees no prompt) runs once per image and the text encoder once per prompt; only the rest of the DETR and the
mask heads see all N pairs. Those are the wrapper's three steps, `encode_image`, `encode_text` and `decode`,
which `Part` exports alone for encode once / decode many.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, Sam3Config, Sam3Model
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.clip.modeling_clip import CLIPAttention
from transformers.models.sam3.modeling_sam3 import (
    Sam3Attention,
    Sam3DetrDecoder,
    Sam3DetrDecoderLayer,
    Sam3DETRDecoderOutput,
    Sam3DetrEncoderLayer,
    Sam3MaskDecoder,
    Sam3MaskDecoderOutput,
    Sam3MLP,
    box_cxcywh_to_xyxy,
    eager_attention_forward,
    inverse_sigmoid,
)

from ..pipeline.schema import OPTIMIZATIONS
from ..runtime import attention, box_bias  # registers the ops sam3_aoti::attention and sam3_aoti::box_bias_mlp
from ..runtime.contract import FP32_IN_BF16, IMAGE_MEAN, IMAGE_STD
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


class _StaticShapeDetrDecoder(Sam3DetrDecoder):
    """Sam3DetrDecoder whose box-bias grid size is a Python int, not a tensor.

    transformers passes the feature height/width as tensors into `torch.arange`, which export turns into
    unbacked symbols (`GuardOnDataDependentSymNode: Eq(u0*u1, 64)`). SAM3 feeds the DETR one square level,
    so the side is known from the config; the class is swapped in on the instance, the library stays untouched.
    """

    static_side: int
    fused_box_bias: bool = False  # `box_bias_kernel`: the MLPs through the op sam3_aoti::box_bias_mlp
    bias_tables: bool = False  # `grid_bias_attention`: hand the attention the per-axis tables, not their sum
    shared_projections: bool = False  # `decoder_shared_projections`: `forward` below, not transformers'

    def _get_rpb_matrix(self, reference_boxes, spatial_shape):
        if not (self.fused_box_bias or self.bias_tables):
            return super()._get_rpb_matrix(reference_boxes, (self.static_side, self.static_side))
        bias_y, bias_x = self._axis_biases(reference_boxes)
        if self.bias_tables:  # [N, heads, Q, 2 * side]; the decoder pads the presence row on, as on the sum
            return torch.cat([bias_y, bias_x], -1)
        return attention.grid_bias(bias_y, bias_x)

    def forward(self, vision_features, text_features, vision_pos_encoding, text_mask=None, spatial_shapes=None,
                **kwargs):
        """transformers' `Sam3DetrDecoder.forward` with `decoder_shared_projections`: the keys and values every
        layer projects from the same image tokens and prompt as one GEMM each for all layers (`stack_linears`),
        before the layers; the presence row never padded onto the box bias; the presence logit and the
        intermediates of the last layer only (the `[-1]` that `decode` reads), whose box refinement `decode`
        does. Otherwise transformers' loop, line for line."""
        if not self.shared_projections:
            return super().forward(vision_features, text_features, vision_pos_encoding, text_mask=text_mask,
                                   spatial_shapes=spatial_shapes, **kwargs)
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
            if not self.bias_tables:  # the presence token's row: it attends to every image token alike
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

    def _axis_biases(self, reference_boxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' `_get_rpb_matrix` up to its last sum: the y and x tables (`[N, heads, Q, side]` each,
        from the MLPs as one fused kernel with `box_bias_kernel`), whose broadcast sum is the bias."""
        side = self.static_side
        coords = torch.arange(side, device=reference_boxes.device, dtype=reference_boxes.dtype) / side
        edges = box_cxcywh_to_xyxy(reference_boxes)

        def log_scaled(box_edges):  # [N, Q, 2] (low, high) -> [N, Q, side, 2], as transformers encodes them
            deltas = (coords[:, None] - box_edges[:, :, None, :]) * 8
            return torch.sign(deltas) * torch.log2(deltas.abs() + 1.0) / math.log2(8)

        mlp = _box_bias_mlp if self.fused_box_bias else _box_bias_linears
        return (mlp(log_scaled(edges[..., 1::2]), self.box_rpb_embed_y),
                mlp(log_scaled(edges[..., 0::2]), self.box_rpb_embed_x))


class _ProjectedAttention(Sam3Attention):
    """transformers' `Sam3Attention.forward` in two steps: the projections, then `attend` on projected queries,
    keys and values (`[B, L, heads * head_dim]` each, any dtype), which a caller that projected the keys and
    values already (`decoder_shared_projections`) calls alone. The class is swapped in on the instance."""

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        return self.attend(self.q_proj(query), self.k_proj(key), self.v_proj(value), attention_mask, query.dtype,
                           **kwargs)

    def heads(self, states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[B, L, heads * head_dim]` -> a `[B, heads, L, head_dim]` view in `dtype`."""
        return states.view(*states.shape[:2], self.num_attention_heads, self.head_dim).transpose(1, 2).to(dtype)

    def attend(self, query, key, value, attention_mask, dtype, **kwargs):
        """The attention and its output projection, computing in `dtype` (the residual stream's)."""
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = interface(self, self.heads(query, dtype), self.heads(key, dtype), self.heads(value, dtype),
                           attention_mask=attention_mask, dropout=0.0, scaling=self.scaling, is_causal=False, **kwargs)
        return self.o_proj(out.reshape(*query.shape[:2], -1).contiguous()), None


class _GridBiasAttention(_ProjectedAttention):
    """The DETR decoder's vision cross-attention on the op `sam3_aoti::attention` with the box bias as its two
    per-axis tables (`_StaticShapeDetrDecoder.bias_tables`: the mask is `[N, heads, Q', 2 * side]`, the y table
    then the x table, for the last Q' queries: with a zero presence row from transformers' decoder, without
    it from ours), so the `[N, heads, 1 + Q, side * side]` sum is never stored."""

    def attend(self, query, key, value, attention_mask, dtype, **kwargs):
        dtype_in = getattr(self, "attention_dtype", dtype)  # set by `attention_in`
        bias_y, bias_x = attention_mask.float().chunk(2, dim=-1)
        out = torch.ops.sam3_aoti.attention(self.heads(query, dtype_in), self.heads(key, dtype_in),
                                            self.heads(value, dtype_in), self.scaling, bias_y, bias_x)
        return self.o_proj(out.to(dtype).reshape(*query.shape[:2], -1)), None


class _SharedProjectionsDecoderLayer(Sam3DetrDecoderLayer):
    """transformers' `Sam3DetrDecoderLayer.forward` on keys and values projected before the layers
    (`_StaticShapeDetrDecoder.forward`), its self-attention's query and key projections as one GEMM
    (`qk_proj`, they read the same input). Dropout is left out: the wrapper runs in eval mode, where it is the
    identity. The class is swapped in on the instance."""

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


class _StackedLinear(nn.Linear):
    """Linear layers that read one input, as one GEMM whose output is theirs side by side. The output stays in
    the weights' dtype (bf16 in a bf16 decoder): each slice is cast where it is read, once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def stack_linears(linears: list[nn.Linear]) -> _StackedLinear:
    """One `_StackedLinear` holding the layers' weights and biases (copies: the layers lose theirs after)."""
    first = linears[0]
    stack = _StackedLinear(first.in_features, first.out_features * len(linears), device="meta")
    stack.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]))
    stack.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]))
    return stack


def share_decoder_projections(decoder: Sam3DetrDecoder) -> None:
    """`decoder_shared_projections`: the text and image keys and values of every layer as four stacked GEMMs
    on the decoder, each self-attention's query and key projections as one; the layers' own go."""
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
            if not isinstance(module, _ProjectedAttention):
                module.__class__ = _ProjectedAttention
        layer.__class__ = _SharedProjectionsDecoderLayer
    decoder.shared_projections = True


class _FusedQKVTextAttention(CLIPAttention):
    """`text_fused_qkv`: transformers' `CLIPAttention.forward` with the query, key and value projections as one
    GEMM (`qkv_proj`, `stack_linears`): at a prompt's 32 tokens each projection is a latency-bound launch (the
    text encoder's 145 GEMMs took 0.76 ms of its 1.8 at 1 x 1 on the H200). The class is swapped in on the
    instance."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        heads = (*hidden_states.shape[:-1], -1, self.head_dim)
        queries, keys, values = (t.view(heads).transpose(1, 2) for t in self.qkv_proj(hidden_states).chunk(3, -1))
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = interface(self, queries, keys, values, attention_mask, scaling=self.scale, dropout=0.0,
                                 **kwargs)
        return self.out_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def fuse_text_projections(text_encoder: nn.Module) -> None:
    """`text_fused_qkv`: each CLIP attention's three projections as one stacked GEMM; theirs go."""
    for module in text_encoder.modules():
        if isinstance(module, CLIPAttention):
            module.qkv_proj = stack_linears([module.q_proj, module.k_proj, module.v_proj])
            del module.q_proj, module.k_proj, module.v_proj
            module.__class__ = _FusedQKVTextAttention


def _phase_taps(kernel: torch.Tensor, dim: int) -> torch.Tensor:
    """`[.., 3, ..]` kernel rows (along `dim`) -> `[2, .., 2, ..]`: for each output row phase of a nearest 2x
    upsampling, the kernel rows that land on each of the two coarse rows it reads, summed (rows i - 1 and i
    for the even phase, i and i + 1 for the odd one). Slices and sums of the weight, no constant: AOTInductor
    would store one beside the weights."""
    first, middle, last = kernel.unbind(dim)
    return torch.stack([torch.stack([first, middle + last], dim), torch.stack([first + middle, last], dim)])


def phase_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`conv2d(interpolate(x, scale_factor=2, mode="nearest"), weight, padding=1)` for a 3 x 3 kernel, in phase
    layout (`to_phases`) and without the upsampled map: each of the four output phases is a 2 x 2 convolution of
    `x` (`_phase_taps`), all four as one convolution with four times the channels (4/9 of the FLOPs); phase
    (a, b) is its output from row a, column b on, taken as slices (an `as_strided` view of it drifted in the
    exported program on the H200: benchmarks/README.md)."""
    out_channels, height, width = weight.shape[0], x.shape[-2], x.shape[-1]
    phases = _phase_taps(_phase_taps(weight, 2), -1).permute(2, 1, 0, 3, 4, 5)  # [b, a, out, ..] -> [out, a, b, ..]
    out = F.conv2d(x, phases.reshape(4 * out_channels, weight.shape[1], 2, 2), padding=1)
    out = out.unflatten(1, (out_channels, 2, 2))  # [N, out, a, b, H + 1, W + 1]
    rows = torch.stack([out[:, :, 0, :, :height], out[:, :, 1, :, 1:]], 2)  # [N, out, a, b, H, W + 1]
    return torch.stack([rows[:, :, :, 0, :, :width], rows[:, :, :, 1, :, 1:]], 3)


def to_phases(x: torch.Tensor) -> torch.Tensor:
    """`[.., C, 2H, 2W]` -> `[.., C, 2, 2, H, W]`, `[a, b, h, w]` being pixel `(2h + a, 2w + b)`: the layout the
    per-image pixel decoder keeps its maps in, where each phase of a nearest 2x upsampling is contiguous."""
    return x.unflatten(-1, (-1, 2)).unflatten(-3, (-1, 2)).movedim((-3, -1), (-4, -3))  # from [.., H, a, W, b]


def from_phases(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_phases`."""
    return x.movedim((-4, -3), (-3, -1)).flatten(-2).flatten(-3, -2)


class _ChannelStatsGroupNorm(nn.GroupNorm):
    """`group_norm_by_channel`: a group norm whose statistics are reduced per channel first, then per group
    from its channels' means and variances (equal counts: the group's variance is the mean of theirs plus the
    variance of their means, Chan's parallel formula, so nothing cancels as `E[x^2] - E[x]^2` would). Why: with
    `pixel_decoder_per_image` the norm at 288 x 288 reduced in one `triton_red` kernel of 1.03 ms at 1 x 16 on
    the H200, where reading the map takes 0.14; its reductions are one per (pair, group), 8 a pair of 2.65 M
    values each, and per channel there are 32 times as many. On the H200 Inductor fuses the phase slices into
    these reductions instead: the mask decoder's kernels 0.2 ms less at 1 x 16 (benchmarks/README.md).
    Any layout `[N, C, ...]`, the phase layout too; fp32 statistics, as the native kernel keeps
    them (fp64 in fp64). The class is swapped in on the instance."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        values = x.to(dtype).reshape(x.shape[0], self.num_groups, self.num_channels // self.num_groups, -1)
        channel_var, channel_mean = torch.var_mean(values, dim=-1, keepdim=True, correction=0)
        mean = channel_mean.mean(2, keepdim=True)
        var = (channel_var + (channel_mean - mean).square()).mean(2, keepdim=True)
        scale = torch.rsqrt(var + self.eps) * self.weight.to(dtype).reshape(1, self.num_groups, -1, 1)
        out = (values - mean) * scale + self.bias.to(dtype).reshape(1, self.num_groups, -1, 1)
        return out.reshape(x.shape).to(x.dtype)


class _PerImageMaskDecoder(Sam3MaskDecoder):
    """`pixel_decoder_per_image`: transformers' `Sam3MaskDecoder.forward` with the backbone levels per image
    (`pairs_per_image` pairs each). Each pixel decoder stage is `relu(norm(conv(upsample(pixels) + level)))`, and
    the convolution is linear: `conv(level)` runs once per image (`laterals`, in `encode_image`),
    `conv(upsample(pixels))` per pair as `phase_conv`. The stages keep their maps in phase layout (a group norm's
    statistics do not depend on the pixels' order), so the norm reads the convolution's output where it lies,
    and only the masks are put back in pixel order, as they are cast to fp32. The 1 x 1 instance projection is
    folded into the mask embeddings (`(m W) . p + m . b` for `m . (W p + b)`), so the per-pair `[C, 288, 288]`
    map it wrote (at SAM3's size) is never stored. The semantic head, which no output reads, is left out. The
    class is swapped in on the instance."""

    def laterals(self, level0: torch.Tensor, level1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per image: each finer backbone level's pixel decoder convolution (with its bias), in phase layout."""
        if level0.shape[-2:] != (2 * level1.shape[-2], 2 * level1.shape[-1]):
            raise ValueError(f"pixel_decoder_per_image: a level of {tuple(level0.shape[-2:])} after one of "
                             f"{tuple(level1.shape[-2:])}; it needs each level twice the next one's size")
        convs = self.pixel_decoder.conv_layers  # the first for the coarser level (transformers' order)
        return to_phases(convs[1](level0)).contiguous(), to_phases(convs[0](level1)).contiguous()

    def forward(self, decoder_queries, backbone_features, encoder_hidden_states, prompt_features, prompt_mask,
                pairs_per_image, **kwargs):
        """`backbone_features`: `laterals`' two maps, then any tensor shaped as the coarsest level."""
        normed = self.prompt_cross_attn_norm(encoder_hidden_states)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=normed,
                                         encoder_hidden_states=prompt_features, attention_mask=prompt_mask)
        attended, _ = self.prompt_cross_attn(query=normed, key=prompt_features, value=prompt_features,
                                             attention_mask=mask, **kwargs)
        tokens = encoder_hidden_states + attended
        height, width = backbone_features[-1].shape[-2:]
        pixels = tokens[:, :height * width].transpose(1, 2).reshape(tokens.shape[0], -1, height, width)
        decoder = self.pixel_decoder
        laterals = reversed(backbone_features[:-1])
        for stage, (conv, norm, lateral) in enumerate(zip(decoder.conv_layers, decoder.norms, laterals)):
            if stage:
                pixels = from_phases(pixels)
            if lateral.shape[-2:] != pixels.shape[-2:]:
                raise ValueError(f"pixel_decoder_per_image: a lateral of {tuple(lateral.shape)} after a map of "
                                 f"{tuple(pixels.shape)}; want `laterals` of levels twice each other's size")
            pixels = F.relu(norm(phase_conv(pixels, conv.weight) + lateral.repeat_interleave(pairs_per_image, 0)))
        embeddings = self.mask_embedder(decoder_queries)
        projection = self.instance_projection
        masks = torch.einsum("bqc,bcp->bqp", embeddings @ projection.weight.flatten(1), pixels.flatten(2))
        masks = masks + (embeddings @ projection.bias)[..., None]
        return Sam3MaskDecoderOutput(pred_masks=from_phases(masks.unflatten(-1, pixels.shape[2:])))


class _PerPairDetrEncoderLayer(Sam3DetrEncoderLayer):
    """SAM3's first DETR encoder layer, split where the prompt comes in: its self-attention over the image
    tokens sees no prompt, so `self_attend` runs it once per image (in `encode_image`), and `forward` runs
    the rest (the cross-attention to the prompt and the MLP) once per (image, prompt) pair. The two halves
    are transformers' `Sam3DetrEncoderLayer.forward`, line for line; the class is swapped in on the instance."""

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


def _box_bias_mlp(deltas: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """A box-bias MLP (`Sam3DecoderMLP`, 2 -> hidden -> heads) as the op `runtime.box_bias` defines."""
    return torch.ops.sam3_aoti.box_bias_mlp(deltas, mlp.layer1.weight, mlp.layer1.bias, mlp.layer2.weight,
                                            mlp.layer2.bias)


def _box_bias_linears(deltas: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """The same MLP as transformers runs it, in the op's `[N, heads, Q, side]` layout."""
    return mlp(deltas).permute(0, 3, 1, 2)


KERNEL_ATTENTION = "sam3_aoti_attention"


def kernel_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface on the op `sam3_aoti::attention` (unmasked: the DETR encoder's
    self-attention over the image tokens, `attention_kernel`), which returns SDPA's `[B, L, H, D]` layout."""
    if attention_mask is not None:
        raise ValueError("the attention kernel takes no mask")
    scale = module.scaling if scaling is None else scaling
    return torch.ops.sam3_aoti.attention(query, key, value, scale), None


class _ReluEpilogueMLP(Sam3MLP):
    """Sam3MLP (ReLU) whose first layer, bias and ReLU are one cuBLASLt GEMM with a ReLU epilogue
    (`torch._addmm_activation`, an op AOTInductor calls through its C shim): Inductor otherwise stores the
    GEMM's output and runs the ReLU over it (about 1 ms of the DETR encoder's 17.6 at 1 x 16 on the H200)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        hidden = torch._addmm_activation(self.fc1.bias, flat, self.fc1.weight.t())
        return self.fc2(hidden.view(*hidden_states.shape[:-1], hidden.shape[-1]))


def optimize(model: Sam3Model, optimizations) -> None:
    """Swap in the classes `[export] optimizations` names (`schema.OPTIMIZATIONS`) on the instances; each
    computes what transformers does, faster (tests/test_model.py)."""
    unknown = set(optimizations) - set(OPTIMIZATIONS)
    if unknown:
        raise ValueError(f"unknown optimizations {sorted(unknown)}: choose from {list(OPTIMIZATIONS)}")
    model.detr_decoder.fused_box_bias = "box_bias_kernel" in optimizations
    model.detr_decoder.bias_tables = "grid_bias_attention" in optimizations
    if "grid_bias_attention" in optimizations:
        for layer in model.detr_decoder.layers:
            layer.vision_cross_attn.__class__ = _GridBiasAttention
    if "decoder_shared_projections" in optimizations:
        share_decoder_projections(model.detr_decoder)
    if "pixel_decoder_per_image" in optimizations:
        model.mask_decoder.__class__ = _PerImageMaskDecoder
    if "text_fused_qkv" in optimizations:
        fuse_text_projections(model.text_encoder)
    if "group_norm_by_channel" in optimizations:
        for norm in model.mask_decoder.pixel_decoder.norms:
            norm.__class__ = _ChannelStatsGroupNorm
    if "attention_kernel" in optimizations:
        AttentionInterface.register(KERNEL_ATTENTION, kernel_attention)
        for layer in model.detr_encoder.layers:  # their configs are their own (`set_masked_attention`)
            layer.self_attn.config._attn_implementation = KERNEL_ATTENTION
    if "relu_epilogue" in optimizations:
        for module in model.detr_encoder.modules():
            if type(module) is Sam3MLP and isinstance(module.activation_fn, nn.ReLU):
                module.__class__ = _ReluEpilogueMLP


def detr_side(config: Sam3Config) -> int:
    """Side of the one feature level the DETR sees (image / patch, scale 1.0)."""
    vit = config.vision_config.backbone_config
    return vit.image_size // vit.patch_size


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


def dense_mask_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface, on SDPA for masked attentions (`dense_mask` gives the layout).

    A causal attention (the CLIP text encoder) runs with `is_causal` and no mask: that is Meta's text
    encoder (a causal mask only; padding never reaches a real token, since tokens are right-padded and
    every later use of the text masks the padding), and it lets the flash and cuDNN kernels take it."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    dtype = getattr(module, "attention_dtype", query.dtype)  # set by `attention_in`
    mask = None if causal or attention_mask is None else dense_mask(attention_mask, dtype, query.shape[2],
                                                                     key.shape[2])
    out = F.scaled_dot_product_attention(query.to(dtype), key.to(dtype), value.to(dtype), attn_mask=mask,
                                         scale=scaling, is_causal=causal and query.shape[2] > 1)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


class _LowPrecisionLinear(nn.Linear):
    """A linear layer whose weights are stored in a low precision and whose GEMM runs in it, taking and giving
    its caller's dtype: what autocast makes of `nn.Linear`, as a module export can trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def linears_in(part: nn.Module, dtype: torch.dtype, keep: tuple[str, ...] = ()) -> None:
    """Run the linear layers of `part` (a module kept in fp32 in a bf16 build) as `dtype` GEMMs with fp32
    inputs and outputs, all but those under the submodules named in `keep`. Everything between them (the
    residual stream, the layer norms, the box refinement) stays fp32, as under Meta's bf16 autocast."""
    for name, module in part.named_modules():
        if isinstance(module, nn.Linear) and not any(name == k or name.startswith(k + ".") for k in keep):
            module.to(dtype)
            module.__class__ = _LowPrecisionLinear


# The DETR decoder's linears a bf16 build keeps fp32 with `box_path_linears = "bf16"`: the heads that turn the
# queries into box offsets and the presence logit (a few hundred FLOPs per query, read straight into outputs).
BOX_PATH_FP32_LINEARS = ("box_head", "presence_head")


def attention_in(part: nn.Module, dtype: torch.dtype) -> None:
    """Run the attentions of `part` (a module kept in fp32 in a bf16 build) in `dtype`, the rest of it
    staying fp32: an fp32 box-biased attention takes the memory-efficient kernel, 5.1 ms for the DETR
    decoder's six layers at 2 x 3 on the H200, against 0.72 ms for cuDNN in bf16 (scripts/speed_levers.py)."""
    from transformers.models.sam3.modeling_sam3 import Sam3Attention

    for module in part.modules():
        if isinstance(module, Sam3Attention):
            module.attention_dtype = dtype


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


def _cast(value, dtype: torch.dtype):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _inputs_to(dtype: torch.dtype):
    """A forward pre-hook that hands a module its floating inputs in its own dtype."""
    return lambda module, args, kwargs: (_cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()})


def keep_box_path_fp32(model: Sam3Model, dtype: torch.dtype, fp32_parts: tuple = FP32_IN_BF16) -> None:
    """Mixed precision for a low-precision model: `contract.FP32_IN_BF16` in fp32, the rest (ViT, text, DETR
    encoder, mask decoder: nearly all the work) in `dtype`; each part gets its inputs in its own dtype. The
    DETR decoder refines each box over its layers (inverse sigmoid, add, sigmoid), and bf16 keeps a box
    coordinate to 1/256 (4 px at 1008) at every step. (Their cost on the H200 is not measured yet.)"""
    for name in fp32_parts:
        getattr(model, name).float().register_forward_pre_hook(_inputs_to(torch.float32), with_kwargs=True)
    model.mask_decoder.register_forward_pre_hook(_inputs_to(dtype), with_kwargs=True)


class Sam3Grounding(nn.Module):
    """Flat, tensor-only signature around Sam3Model for export (see module docstring)."""

    def __init__(self, model: Sam3Model, dtype: torch.dtype = torch.float32, fp32_parts: tuple = FP32_IN_BF16,
                 masked_attention: str = "sdpa", box_path_attention: str = "fp32", box_path_linears: str = "fp32",
                 fp8_parts: tuple = (), optimizations: tuple = ()):
        super().__init__()
        model.to(dtype)
        if dtype != torch.float32:
            keep_box_path_fp32(model, dtype, fp32_parts)
            if box_path_attention == "bf16" and masked_attention == "sdpa":
                attention_in(model.detr_decoder, dtype)
            if box_path_linears == "bf16" and "detr_decoder" in fp32_parts:
                linears_in(model.detr_decoder, dtype, keep=BOX_PATH_FP32_LINEARS)
        if fp8_parts:  # precision=fp8: a bf16 build whose ViT linears are rowwise-scaled fp8 GEMMs (fp8.py)
            from .fp8 import quantize_linears

            for name in fp8_parts:
                quantize_linears(model.get_submodule(name))
        self.dtype = dtype
        decoder = model.detr_decoder
        decoder.__class__ = _StaticShapeDetrDecoder
        decoder.static_side = detr_side(model.config)
        model.detr_encoder.layers[0].__class__ = _PerPairDetrEncoderLayer
        set_masked_attention(model, masked_attention)
        optimize(model, optimizations)
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
        optimizations = opts.get("optimizations", ()) if optimizations is None else optimizations
        return cls.at(model, settings.spec, masked_attention=opts["masked_attention"],
                      box_path_attention=opts["box_path_attention"],
                      box_path_linears=opts["box_path_linears"], optimizations=tuple(optimizations)).eval()

    def forward(self, images: torch.Tensor, token_ids: torch.Tensor):
        return self.decode(*self.encode_image(images), *self.encode_text(token_ids))

    def encode_image(self, images: torch.Tensor):
        """Per image, what the heads read of it: the two finer FPN levels (the mask decoder's; with
        `pixel_decoder_per_image`, their pixel-decoder convolutions, `_PerImageMaskDecoder.laterals`), the DETR's
        level after the DETR encoder's first self-attention (which sees no prompt), the position encoding of
        that level, and the no-box geometry prompt (it attends to the image only)."""
        vision = self.model.get_vision_features(pixel_values=images.to(self.dtype))
        level0, level1, level2 = vision.fpn_hidden_states[:-1]  # Sam3Model drops the coarsest level
        position = vision.fpn_position_encoding[-2]
        attended = self.model.detr_encoder.layers[0].self_attend(level2, position)
        if self.per_image_laterals:  # the mask decoder's per-image convolutions of them, once per image
            level0, level1 = self.model.mask_decoder.laterals(level0, level1)
        return level0, level1, attended, position, self.empty_geometry_prompt(vision)

    @property
    def per_image_laterals(self) -> bool:
        """`pixel_decoder_per_image`: the finer levels go to the heads as their convolutions (a part's pruned
        model may hold no mask decoder: `Part`)."""
        return isinstance(self.model._modules.get("mask_decoder"), _PerImageMaskDecoder)

    def encode_text(self, token_ids: torch.Tensor):
        """Per prompt: the text encoder's token features and their mask (`token_ids != 0`)."""
        attention_mask = (token_ids != 0).long()
        text = self.model.get_text_features(input_ids=token_ids, attention_mask=attention_mask)
        return text.pooler_output, attention_mask

    def decode(self, level0, level1, attended, position, geometry, text_features, attention_mask):
        """The heads over every (image, prompt) pair of encoded images and encoded prompts: what
        `Sam3Model.forward` runs after its encoders for a text prompt, with the boxes and scores of the last
        decoder layer only (the model's outputs; Sam3Model scores all six and keeps the last)."""
        model, batch, prompts = self.model, level0.shape[0], text_features.shape[0]

        def pairs(image_tensor):  # pair i = (image i // P, prompt i % P)
            return image_tensor.repeat_interleave(prompts, dim=0)

        prompt = torch.cat([text_features.repeat(batch, 1, 1), pairs(geometry)], dim=1)
        prompt_mask = torch.cat([attention_mask.repeat(batch, 1), attention_mask.new_ones(batch * prompts, 1)],
                                dim=1).bool()
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
        no-box path (the box pooling, which needs torchvision, has nothing to pool)."""
        encoder = self.model.geometry_encoder
        feats, pos = vision.fpn_hidden_states[-2], vision.fpn_position_encoding[-2]  # the level it attends to
        cls = encoder.cls_embed.weight.view(1, 1, -1).expand(feats.shape[0], 1, -1)
        prompt = encoder.prompt_layer_norm(encoder.final_proj(cls))
        feats, pos = feats.flatten(2).transpose(1, 2), pos.flatten(2).transpose(1, 2)
        for layer in encoder.layers:
            prompt = layer(prompt_feats=prompt, vision_feats=feats, vision_pos_encoding=pos, prompt_mask=None)
        return encoder.output_layer_norm(prompt)


# `model` = decode(*encode_image(images), *encode_text(token_ids)); each part and the Sam3Model submodules it reads
# (encode_image also the pixel decoder's convolutions with `pixel_decoder_per_image`: `Part`)
PARTS = {
    "encode_image": ("vision_encoder", "geometry_encoder", "detr_encoder.layers.0"),
    "encode_text": ("text_encoder", "text_projection"),
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
        laterals = name == "encode_image" and grounding.per_image_laterals
        model = _pruned(grounding.model, PARTS[name] + (("mask_decoder.pixel_decoder.conv_layers",) * laterals))
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

