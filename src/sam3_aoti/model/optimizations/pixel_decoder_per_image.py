"""`pixel_decoder_per_image`: the mask decoder's convolutions split into a per-image half on the backbone
levels (run by `encode_image`, which then returns them in place of the levels) and a per-pair half on the
coarser map (four 2 x 2 sub-pixel convolutions in one), its maps kept in phase layout and its 1 x 1
projection folded into the mask embeddings. Fewer FLOPs from two prompts per image on, more at one. Measured
in benchmarks/README.md."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.sam3.modeling_sam3 import Sam3MaskDecoder, Sam3MaskDecoderOutput

from .registry import register


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


class PerImageMaskDecoder(Sam3MaskDecoder):
    """`pixel_decoder_per_image`: transformers' `Sam3MaskDecoder.forward` with the backbone levels per image
    (`pairs_per_image` pairs each). Each pixel decoder stage is `relu(norm(conv(upsample(pixels) + level)))`, and
    the convolution is linear: `conv(level)` runs once per image (`laterals`, in `encode_image`),
    `conv(upsample(pixels))` per pair as `phase_conv`. The stages keep their maps in phase layout (a group norm's
    statistics do not depend on the pixels' order), so the norm reads the convolution's output where it lies,
    and only the masks are put back in pixel order, as they are cast to fp32. The 1 x 1 instance projection is
    folded into the mask embeddings (`(m W) . p + m . b` for `m . (W p + b)`), so the per-pair `[C, 288, 288]`
    map it wrote (at SAM3's size) is never stored. The semantic head, which no output reads, is left out."""

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


# encode_image returns the laterals instead of the levels, and decode reads them (`grounding.Sam3Grounding`).
@register("pixel_decoder_per_image", changes_parts=("encode_image", "decode"),
          part_reads={"encode_image": ("mask_decoder.pixel_decoder.conv_layers",)})
def apply(model: nn.Module) -> None:
    model.mask_decoder.__class__ = PerImageMaskDecoder
