"""`python -m sam3_aoti`: the `sam3-aoti` command (predict, info)."""

from .runtime.cli import main

main()
