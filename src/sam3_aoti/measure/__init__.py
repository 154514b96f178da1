"""Measurement as a library: timing, FLOPs and weights read, the card's rates and a part's floor, kernel
categories from the profiler, load times in fresh processes, and the model's sections timed alone. The bench stage
(`stages/bench.py`) orchestrates them into its report; scripts/ call them directly. Torch is imported inside
the functions: doit loads nothing heavy."""
