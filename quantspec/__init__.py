"""quantspec: post-training quantization for decoder LLMs and a speculative-decoding runtime
that runs exactly the artifacts it produces."""

from quantspec.threads import limit_spin_wait

__version__ = "0.1.0"
__all__ = ["__version__"]

# OpenMP reads its wait policy once, when torch loads it: this has to run before torch's import
# (see quantspec/threads.py)
limit_spin_wait()
