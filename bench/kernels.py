"""Benchmark quantspec's Triton GEMM kernels against torch fp16 matmul on Llama-3-8B layer shapes.

    python bench/kernels.py [--dtype fp16|bf16] [--m 1,16,64,256,4096]

Each cell is `triton.testing.do_bench` (L2 flushed between runs), measured side by side in one
run; ratios are torch time / kernel time (> 1 means the quantized kernel is faster). Targets on
H100: W4A16 M=1 >= 3x at 4096x14336, W8A16 M=1 >= 1.8x, W8A8 / FP8 at M=4096 >= 1.5x.
W8A8 and FP8 times include the activation-quantize kernel (what a linear layer pays).
"""

from __future__ import annotations

import argparse
import sys

import torch

# (K, N) = (in_features, out_features) of Llama-3-8B's linears
SHAPES = [(4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096)]
GROUP_SIZE = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--m", default="1,16,64,256,4096", help="comma-separated batch sizes M")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (Triton kernels); none is available here. "
              "Correctness on CPU is covered by `pytest tests/kernels` under TRITON_INTERPRET=1.")
        return 2

    import triton.testing

    from quantspec.kernels import (
        fp8_linear,
        int8_gemm,
        quantize_act_int8,
        w4a16_linear,
        w8a16_linear,
    )
    from quantspec.quant.packing import pack_int4

    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    ms_list = [int(m) for m in args.m.split(",")]
    cc = torch.cuda.get_device_capability()
    has_fp8 = cc >= (8, 9)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    print(f"## quantspec kernels vs torch {args.dtype} matmul on {torch.cuda.get_device_name()} "
          f"(cc {cc[0]}.{cc[1]}, torch {torch.__version__})\n")
    cols = ["K×N", "M", f"torch {args.dtype} ms", "W4A16 ms (×)", "W8A16 ms (×)", "W8A8 ms (×)"]
    cols.append("FP8 ms (×)" if has_fp8 else "FP8 (cc < 8.9: n/a)")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for K, N in SHAPES:
        w = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen) * 0.02
        q4 = torch.randint(-8, 8, (N, K), device="cuda", dtype=torch.int8, generator=gen)
        w4 = pack_int4(q4)
        s4 = torch.rand(N, K // GROUP_SIZE, device="cuda", generator=gen).to(dtype) * 0.01
        q8 = torch.randint(-128, 128, (N, K), device="cuda", dtype=torch.int8, generator=gen)
        s8 = torch.rand(N, device="cuda", generator=gen) * 1e-3
        s8h = s8.to(dtype)
        w_fp8 = w.float().div(0.001).clamp(-448, 448).to(torch.float8_e4m3fn)
        x_scale = torch.tensor([0.02], device="cuda")
        for M in ms_list:
            x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
            t_ref = bench(lambda: x @ w.t())
            cells = [f"{K}×{N}", str(M), f"{t_ref:.4f}"]
            for fn in (
                lambda: w4a16_linear(x, w4, s4, GROUP_SIZE),
                lambda: w8a16_linear(x, q8, s8h),
                lambda: int8_gemm(*quantize_act_int8(x, x_scale), q8, s8, None, dtype),
            ):
                t = bench(fn)
                cells.append(f"{t:.4f} ({t_ref / t:.2f}×)")
            if has_fp8:
                t = bench(lambda: fp8_linear(x, w_fp8, s8, x_scale))
                cells.append(f"{t:.4f} ({t_ref / t:.2f}×)")
            else:
                cells.append("n/a")
            print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
