"""AOTInductor helpers of the build: compiles without weights, autotuning decisions kept as files, and the
weights blob rebuilt from an exported archive."""
