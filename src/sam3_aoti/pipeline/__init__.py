"""The pipeline's own ground (imports no torch, so doit loads it): settings with the precision table, their
schema, every path, the manifest, the stage runner, the cases, drift metrics and reports."""
