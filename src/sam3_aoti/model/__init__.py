"""The model side of the build: the export wrapper around `transformers.Sam3Model`, its configs, fp8, Meta's
checkpoint key table, checkpoint loading, Meta's own model for parity, and the cache of eager outputs."""
