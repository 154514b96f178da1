"""One module per doit stage, each runnable alone (`python -m sam3_aoti.stages.<stage> --help`). Nothing imports
a stage: what two stages share lives in a layer below (the layering test keeps it so)."""
