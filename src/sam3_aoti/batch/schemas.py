"""Every Arrow schema of `segment`, in one place: what decoding hands the model actor, what the actor hands back,
and the dataset's three tables (`dataset`). Imported without pyarrow; each schema imports it when built."""

from __future__ import annotations


INSTANCE_FIELDS = ("prompt", "query", "score", "box_xyxy", "mask_area", "mask_counts")


def instance_type(packed: bool = False):
    """An instance as Arrow stores it: the score as the model's float32, the box in pixels of the image
    (x0, y0, x1, y1), the mask's area and COCO RLE counts (its size is the image's). `packed`: as the model actor
    hands it on, the mask as bits (`postprocess.pack_bits`) in place of the counts (`worker.encode_masks`)."""
    import pyarrow as pa

    return pa.struct([("prompt", pa.string()), ("query", pa.int32()), ("score", pa.float32()),
                      ("box_xyxy", pa.list_(pa.float64(), 4)), ("mask_area", pa.int64()),
                      ("mask_bits", pa.large_binary()) if packed else ("mask_counts", pa.string())])


def decoded_schema():
    import pyarrow as pa

    return pa.schema([("source", pa.string()), ("pixels", pa.large_binary()), ("width", pa.int32()),
                      ("height", pa.int32()), ("error", pa.string())])


def segmented_schema(packed: bool = False):
    """A row per image; `packed`: as the model actor hands it on (`found_schema`)."""
    import pyarrow as pa

    return pa.schema([("source", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
                      ("error", pa.string()), ("seconds", pa.float64()),
                      ("instances", pa.list_(instance_type(packed)))])


def found_schema():
    """What the model actor hands the CPU stage: the rows of `segmented_schema`, masks as bits."""
    return segmented_schema(packed=True)


INSTANCE_COLUMNS = ("source", "width", "height", "prompt", "query", "score", "box_xyxy", "mask_area", "mask_counts")


def instances_schema():
    import pyarrow as pa

    inner = {field.name: field.type for field in instance_type()}
    return pa.schema([("source", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
                      *((name, inner[name]) for name in INSTANCE_COLUMNS[3:])])


def images_schema():
    import pyarrow as pa

    return pa.schema([("source", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
                      ("instances", pa.int32()), ("seconds", pa.float64())])


def errors_schema():
    import pyarrow as pa

    return pa.schema([("source", pa.string()), ("error", pa.string())])
