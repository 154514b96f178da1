"""What a service installs and imports: the loader, integrity checks, CUDA graphs, the tokenizer with its
vocabulary, the package contract, postprocessing, archive reading, `info` and the `sam3-aoti` command.

It imports torch and small pure-Python packages (numpy, pillow, regex, ftfy) only, never the build side
(doit, transformers, `sam3_aoti.pipeline`...); the layering test (import-linter) keeps it so.
"""
