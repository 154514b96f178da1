"""sam3-aoti: SAM3 text grounding, exported and AOT-compiled into one verified package."""
