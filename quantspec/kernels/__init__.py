"""quantspec.kernels: Triton kernels for quantized GEMMs and the quantized paged KV cache, each
beside a torch reference (`*_ref`) with the same signature.

Mechanism only: which op to call for a device / M / quant type is decided by the quantized linear
in `infer/`. `triton_usable(device)` says whether the Triton path can run on a device at all (CUDA;
on CPU only under TRITON_INTERPRET=1, otherwise use the references).
"""

from quantspec.kernels._common import triton_usable
from quantspec.kernels.fp8 import (
    check_fp8_device,
    fp8_gemm,
    fp8_gemm_ref,
    fp8_linear,
    fp8_linear_ref,
    quantize_act_fp8,
    quantize_act_fp8_ref,
)
from quantspec.kernels.kv_cache import (
    paged_attention,
    paged_attention_ref,
    write_kv_cache,
    write_kv_cache_ref,
)
from quantspec.kernels.w4a16 import W4A16Config, w4a16_linear, w4a16_linear_ref
from quantspec.kernels.w8a8 import (
    int8_gemm,
    int8_gemm_ref,
    quantize_act_int8,
    quantize_act_int8_ref,
    w8a8_linear,
    w8a8_linear_ref,
)
from quantspec.kernels.w8a16 import w8a16_linear, w8a16_linear_ref

__all__ = [
    "W4A16Config",
    "check_fp8_device",
    "fp8_gemm",
    "fp8_gemm_ref",
    "fp8_linear",
    "fp8_linear_ref",
    "int8_gemm",
    "int8_gemm_ref",
    "paged_attention",
    "paged_attention_ref",
    "quantize_act_fp8",
    "quantize_act_fp8_ref",
    "quantize_act_int8",
    "quantize_act_int8_ref",
    "triton_usable",
    "w4a16_linear",
    "w4a16_linear_ref",
    "w8a16_linear",
    "w8a16_linear_ref",
    "w8a8_linear",
    "w8a8_linear_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
