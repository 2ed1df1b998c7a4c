"""quantspec: post-training quantization for decoder LLMs and a speculative-decoding runtime
that runs exactly the artifacts it produces."""

__version__ = "0.1.0"
__all__ = ["__version__"]
