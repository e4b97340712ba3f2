"""readback: which value does each FP8 backward read, and what does that do to training."""

__version__ = "0.1.0"
