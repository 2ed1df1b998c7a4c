"""quantspec.kernels: Triton kernels for quantized GEMMs, the quantized paged KV cache and the
small ops between a layer's projections (`fused`), each beside a torch reference (`*_ref`) with
the same signature.

Mechanism only: which op to call for a device / M / quant type is decided in `infer/dispatch.py`.
`triton_usable(device)` says whether the Triton path can run on a device at all (CUDA; on CPU
only under TRITON_INTERPRET=1, otherwise use the references).

`kernels.cpu` holds the CPU kernels (C++ in `csrc/`, built at first use), each with a `*_ref`
twin too. Names are imported lazily, so that the CPU paths never import triton (whose
TRITON_INTERPRET switch is read once, at its import).
"""

import importlib

_WHERE = {
    "W4A16Config": "quantspec.kernels.w4a16",
    "add_rms_norm": "quantspec.kernels.fused",
    "add_rms_norm_ref": "quantspec.kernels.fused",
    "check_fp8_device": "quantspec.kernels.fp8",
    "fp8_block_gemm": "quantspec.kernels.fp8_block",
    "fp8_block_gemm_ref": "quantspec.kernels.fp8_block",
    "fp8_block_linear": "quantspec.kernels.fp8_block",
    "fp8_block_linear_ref": "quantspec.kernels.fp8_block",
    "fp8_gemm": "quantspec.kernels.fp8",
    "fp8_gemm_ref": "quantspec.kernels.fp8",
    "fp8_linear": "quantspec.kernels.fp8",
    "fp8_linear_ref": "quantspec.kernels.fp8",
    "fp8_scaled_mm_linear": "quantspec.kernels.fp8",
    "int8_gemm": "quantspec.kernels.w8a8",
    "mxfp4_linear": "quantspec.kernels.mxfp4",
    "mxfp4_linear_ref": "quantspec.kernels.mxfp4",
    "nvfp4_linear": "quantspec.kernels.fp4",
    "nvfp4_linear_ref": "quantspec.kernels.fp4",
    "int8_gemm_ref": "quantspec.kernels.w8a8",
    "paged_attention": "quantspec.kernels.kv_cache",
    "paged_attention_ref": "quantspec.kernels.kv_cache",
    "quantize_act_fp8": "quantspec.kernels.fp8",
    "quantize_act_fp8_group": "quantspec.kernels.fp8_block",
    "quantize_act_fp8_group_ref": "quantspec.kernels.fp8_block",
    "quantize_act_fp8_ref": "quantspec.kernels.fp8",
    "quantize_act_int8": "quantspec.kernels.w8a8",
    "quantize_act_mxfp4": "quantspec.kernels.mxfp4",
    "quantize_act_mxfp4_ref": "quantspec.kernels.mxfp4",
    "quantize_act_nvfp4": "quantspec.kernels.fp4",
    "quantize_act_nvfp4_ref": "quantspec.kernels.fp4",
    "quantize_act_int8_ref": "quantspec.kernels.w8a8",
    "rope_qk_": "quantspec.kernels.fused",
    "rope_qk_ref": "quantspec.kernels.fused",
    "silu_mul": "quantspec.kernels.fused",
    "silu_mul_ref": "quantspec.kernels.fused",
    "triton_usable": "quantspec.kernels._common",
    "w4a16_dequantize": "quantspec.kernels.w4a16",
    "w4a16_dequantize_ref": "quantspec.kernels.w4a16",
    "w4a16_linear": "quantspec.kernels.w4a16",
    "w4a16_linear_ref": "quantspec.kernels.w4a16",
    "w8a16_dequantize": "quantspec.kernels.w8a16",
    "w8a16_dequantize_ref": "quantspec.kernels.w8a16",
    "w8a16_linear": "quantspec.kernels.w8a16",
    "w8a16_linear_ref": "quantspec.kernels.w8a16",
    "w8a8_linear": "quantspec.kernels.w8a8",
    "w8a8_linear_ref": "quantspec.kernels.w8a8",
    "write_kv_cache": "quantspec.kernels.kv_cache",
    "write_kv_cache_ref": "quantspec.kernels.kv_cache",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'quantspec.kernels' has no attribute {name!r}")
