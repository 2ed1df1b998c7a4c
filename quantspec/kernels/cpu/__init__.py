"""quantspec's CPU kernels: C++ (AVX-512) ops for decode, verification and prefill on x86 CPUs,
each bound with a Python wrapper beside a torch reference (`*_ref`) with the same signature.

- `gemm`: y = x @ Wᵀ over packed fp32 / bf16 / int8 / int4 / FP4 weights, any number of rows;
- `attention`: paged attention over a block-table cache;
- `rows`: RMSNorm, the rotary embedding, silu(gate) * up;
- `greedy`: exact greedy ids from a smaller copy of a head (the screens);
- `layouts`: the packed weight layouts those ops read;
- `build`: the one extension module (`cpu_kernels()`: None where it cannot run).

Every op computes a row's numbers the same way whatever the number of rows, so a decode row and
the same row in a verification step agree bitwise. Mechanism only: which op runs for a layer is
decided by the caller (`infer/cpu`).
"""

from quantspec.kernels.cpu.attention import paged_attention, paged_attention_ref
from quantspec.kernels.cpu.build import ENV_SWITCH, cpu_kernels, cpu_kernels_error, pair_path_available
from quantspec.kernels.cpu.gemm import (K_MULTIPLE, X_DTYPES, dense_gemv, dense_gemv_ref, packed_fp4_gemm,
                                        packed_fp4_gemm_ref, packed_gemm, packed_gemm_ref, packed_pairs_gemm,
                                        packed_pairs_gemm_ref, packed_w4_gemm, packed_w4_gemm_ref, packed_w8_gemm,
                                        packed_w8_gemm_ref)
from quantspec.kernels.cpu.greedy import (PAIR_ABS_ERR, has_int8_screen, int8_screen_tables, row_norms_up,
                                          screen_bound, screened_argmax, screened_argmax_i8, screened_argmax_i8_ref,
                                          screened_argmax_pairs, screened_argmax_pairs_ref, screened_argmax_ref)
from quantspec.kernels.cpu.layouts import (PACK_BLOCK, PairRows, pack_dense, pack_fp4_blocks, pack_pairs, pack_w4, pack_w8,
                                           pack_w8_pairs, unpack_dense, unpack_fp4_blocks, unpack_pairs, unpack_w4,
                                           unpack_w8, unpack_w8_pairs)
from quantspec.kernels.cpu.rows import rms_norm, rms_norm_ref, rope, rope_ref, silu_mul, silu_mul_ref

__all__ = [
    "ENV_SWITCH", "K_MULTIPLE", "PACK_BLOCK", "PAIR_ABS_ERR", "X_DTYPES",
    "cpu_kernels", "cpu_kernels_error", "pair_path_available", "has_int8_screen",
    "dense_gemv", "dense_gemv_ref", "packed_gemm", "packed_gemm_ref", "packed_pairs_gemm", "packed_pairs_gemm_ref",
    "packed_w4_gemm", "packed_w4_gemm_ref", "packed_w8_gemm", "packed_w8_gemm_ref", "packed_fp4_gemm",
    "packed_fp4_gemm_ref",
    "paged_attention", "paged_attention_ref",
    "rms_norm", "rms_norm_ref", "rope", "rope_ref", "silu_mul", "silu_mul_ref",
    "int8_screen_tables", "row_norms_up", "screen_bound", "screened_argmax", "screened_argmax_i8",
    "screened_argmax_i8_ref", "screened_argmax_pairs", "screened_argmax_pairs_ref", "screened_argmax_ref",
    "PairRows", "pack_dense", "pack_fp4_blocks", "pack_pairs", "pack_w4", "pack_w8", "pack_w8_pairs",
    "unpack_dense", "unpack_fp4_blocks", "unpack_pairs", "unpack_w4", "unpack_w8", "unpack_w8_pairs",
]
