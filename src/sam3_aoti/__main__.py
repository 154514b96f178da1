"""`python -m sam3_aoti`: the `sam3-aoti` command (predict, info)."""

from .cli import main

main()
