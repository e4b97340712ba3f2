"""readback: which value does each FP8 backward read, and what does that do to training."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``readback.convert`` is imported on first use, so ``import readback`` stays light."""
    if name == "convert":
        from readback.backends.convert import convert

        return convert
    raise AttributeError(f"module 'readback' has no attribute {name!r}")
