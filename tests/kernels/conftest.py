"""Kernel tests run Triton through its CPU interpreter.

TRITON_INTERPRET is read when triton is first imported, so it is set here, at collection of this
directory. Only the kernels (and these tests) import triton on CPU, so setting it for the whole
process does not change other test directories. A machine with CUDA keeps the real compiler
(unless the variable is already set) so the GPU-only tests there exercise real kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
