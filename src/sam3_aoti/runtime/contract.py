"""What a package promises its consumers, in one place, importing neither torch nor transformers: the
exporter writes it into the metadata, the loader, `predict` and the consumer tests read it from here.
(The tokenizer's ids and special tokens live in `runtime.tokenizer`, torch-free as well.)"""

METADATA_FORMAT = "sam3-aoti/3"  # 3: encode_boxes, and decode takes a geometry prompt of any length
OUTPUT_NAMES = ("pred_logits", "pred_boxes", "pred_masks", "presence_logit_dec")
# The split models' features (a split package): encode_image's outputs, then encode_text's; decode takes both.
# mask_level0/1: what the mask decoder reads of the two finer FPN levels (the levels; with the optimization
# pixel_decoder_per_image, their pixel-decoder convolutions, in its phase layout). fpn_level2_attended: the DETR's
# level after the DETR encoder's first self-attention (it sees no prompt).
# geometry_prompt/geometry_mask: the no-box geometry prompt (one token) and its mask, which encode_boxes' exemplar
# tokens replace; fpn_level2: the DETR's level as the ViT left it, which encode_boxes pools boxes from.
IMAGE_FEATURES = ("mask_level0", "mask_level1", "fpn_level2_attended", "position_encoding", "geometry_prompt",
                  "geometry_mask", "fpn_level2")
GEOMETRY = ("geometry_prompt", "geometry_mask")
DECODE_INPUTS = (*IMAGE_FEATURES[:6], "text_features", "text_mask")  # geometry from encode_image or encode_boxes
TEXT_FEATURES = ("text_features", "text_mask")
# Exemplar boxes (encode_boxes): per image, normalized (cx, cy, w, h) with labels, padded per image as
# transformers' input_boxes_labels: 1 positive, 0 negative, -10 padding. With no phrase, Meta's "visual".
BOX_INPUTS = ("fpn_level2", "position_encoding", "boxes", "box_labels")
POSITIVE, NEGATIVE, PADDING = 1, 0, -10
MAX_BOXES = 32
VISUAL_PROMPT = "visual"

PAIRING = "pair i = (image i // num_prompts, prompt i % num_prompts)"
BOX_FORMAT = "cxcywh, normalized to [0, 1]"
MASK_FORMAT = "logits; > 0 is foreground"
SCORE = "sigmoid(pred_logits) * sigmoid(presence_logit_dec)"

# transforms: [B,3,H,W] float in [0, 255] -> resized, rounded to uint8 levels, / 255, then (x - mean) / std.
IMAGE_RANGE = (0, 255)
IMAGE_MEAN = 0.5
IMAGE_STD = 0.5
RESIZE = "bilinear, antialias, rounded to whole uint8 levels (as Meta's Sam3Processor)"

# Parts of a low-precision build that run in fp32 (model.mixed_precision.keep_box_path_fp32 says why; the precision table
# of pipeline.precision names them).
FP32_IN_BF16 = ("detr_decoder", "dot_product_scoring")
# Parts whose linear layers an fp8 build runs as rowwise-scaled fp8 GEMMs (model.fp8); the rest is bf16.
FP8_PARTS = ("vision_encoder.backbone",)
FP8_CAPABILITY = (8, 9)  # the compute capability fp8 tensor cores came with (Ada; Hopper is 9.0)
FP8_NEEDS = f"compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer: Ada, Hopper"  # errors say so
