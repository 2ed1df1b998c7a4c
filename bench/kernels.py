"""quantspec's Triton GEMM kernels against torch's matmul on Llama-3-8B layer shapes, with the
alternative each kernel competes with and what dispatch picks, in one run.

    python bench/kernels.py [--dtype fp16,bf16] [--m 1,16,64,256,4096] [--out DIR] [--sweep-only]
    python bench/kernels.py --device cpu          # tiny shapes under TRITON_INTERPRET=1 (smoke)

Per quant type one table: rows (K×N, M); columns torch's matmul on the float weight, the Triton kernel, the same
kernel under its other launch (`flipped_ops`: the other tile orientation of a weight-only kernel; W8A8 / FP8 unsplit
where the default splits K), for W4A16 the kernel over the quartered layout (`w4a16.quarter_int4`, its own launches),
the library's alternative to it (the weight dequantized by Triton, then cuBLAS, for W4A16 / W8A16; `torch._scaled_mm`
for FP8; `torch._int_mm` + the scale epilogue for W8A8) and dispatch's choice (`infer/dispatch.py`) with its time;
ratios are torch's time / that time (> 1: faster than the float matmul). W8A8, FP8, NVFP4 and MXFP4 (W4A4: no library
alternative) times include quantizing the activations (what a linear layer pays). Each CUDA cell is GPU time per call
(`gpu_time`: calls replayed from a CUDA graph, the L2 flushed before each, as the engine's decode steps run them); on
CPU a median of a few calls. `--out DIR` writes `kernels_<dtype>.md` and `.json` there.

`--sweep-only`: instead of the tables, W8A8's int8 GEMM at M = 4096 under `SCALED_SWEEP`'s tiles, W4A16's dequantize
(what a large M multiplies with cuBLAS) under `DEQUANT_SWEEP`'s tiles on each shape, then W4A16 and W8A16 at M ∈ {1,
16, 256, 4096} on 4096×14336 and at M ∈ {1, 16} on two more shapes, under every launch config of a small grid
(`sweep_grid`: `tl.dot` tiles with and without the scale folded in, one-row programs, W4A16's nibble dots; large-M
tiles), each against the default heuristic's (`kernels_sweep.md` / `.json`, every config's time in the JSON: what
tunes the heuristics).

Targets (H100 / H200, through dispatch): W4A16 M=1 ≥ 3.0× at 4096×14336, W8A16 M=1 ≥ 1.8×, W8A8 and FP8 at M=4096
≥ 1.5×, nothing below 0.9×.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

GPU_SHAPES = [(4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096)]  # (K, N) of Llama-3-8B
CPU_SHAPES = [(128, 48)]  # K = 128: the quartered layout applies
GROUP_SIZE = 128
KINDS = ("w4a16", "w8a16", "w8a16_fp8", "w8a8", "fp8", "nvfp4", "mxfp4")  # w8a16_fp8: FP8 weights, float inputs
FP4_KINDS = {"nvfp4": "tensor_group", "mxfp4": "group"}  # their weight strategies (W4A4, no library alternative)
DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}  # --dtype → torch
ALT_NAMES = {"w4a16": "dequantize + mm", "w8a16": "dequantize + mm", "w8a16_fp8": "dequantize + mm", "w8a8": "_int_mm",
             "fp8": "_scaled_mm"}


def _timer(device):
    import torch

    if device.type == "cuda":
        return gpu_time

    def cpu_time(fn):
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    del torch
    return cpu_time


def _replay_ms(graph) -> float:
    import torch

    graph.replay()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def gpu_time(fn, reps: int = 20) -> float:
    """Milliseconds of GPU time per call of `fn`, as a decode step replayed from a CUDA graph pays
    it: `reps` calls captured in one graph, each after a 256 MB write that flushes the L2 (the
    weights come from HBM, as in a model's sweep over its layers), minus a graph of the flushes
    alone. Python's launch overhead is not in it (the engine's decode steps replay graphs)."""
    import torch

    flush = torch.empty(64 * 2 ** 20, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with_fn, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(with_fn):
        for _ in range(reps):
            flush.zero_()
            fn()
    with torch.cuda.graph(flushes):
        for _ in range(reps):
            flush.zero_()
    return max(_replay_ms(with_fn) - _replay_ms(flushes), 0.0) / reps


class Layer:
    """One (K, N) layer's weights in every kernel's layout, built on `device`."""

    def __init__(self, K: int, N: int, dtype, device, gen):
        import torch

        from quantspec.quant.packing import pack_int4

        self.K, self.N, self.dtype, self.device = K, N, dtype, device
        self.group = g = min(GROUP_SIZE, K)
        self.w = (torch.randn(N, K, device=device, generator=gen) * 0.02).to(dtype)
        self.q4 = torch.randint(-8, 8, (N, K), device=device, dtype=torch.int8, generator=gen)
        self.w4 = pack_int4(self.q4)
        from quantspec.kernels.w4a16 import QUARTER_BLOCK, quarter_int4

        # the quartered layout (`w4a16.quarter_int4`) where K and the group allow it
        self.w4q = quarter_int4(self.w4, K) if K % QUARTER_BLOCK == 0 and g % QUARTER_BLOCK == 0 else None
        self.s4 = (torch.rand(N, K // g, device=device, generator=gen) * 0.01 + 1e-3).to(dtype)
        self.q8 = torch.randint(-127, 128, (N, K), device=device, dtype=torch.int8, generator=gen)
        self.s8 = torch.rand(N, device=device, generator=gen) * 1e-3 + 1e-4
        self.s8h = self.s8.to(dtype)
        self.w_fp8 = self.w.float().div(1e-3).clamp(-448, 448).to(torch.float8_e4m3fn)
        self.x_scale, self.x_scale_fp8 = torch.tensor([0.02], device=device), torch.tensor([4.0 / 448], device=device)
        self.p4 = torch.randint(0, 256, (N, K // 2), device=device, dtype=torch.uint8, generator=gen)  # NVFP4 codes
        self.sfp4 = (torch.rand(N, K // 16, device=device, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
        self.g4, self.g4x = torch.tensor([1000.0], device=device), torch.tensor([500.0], device=device)
        self.smx = torch.randint(110, 130, (N, K // 32), device=device, dtype=torch.uint8, generator=gen)  # E8M0


def kernel_ops(L: Layer, x):
    """kind → (Triton kernel fn, the library's alternative fn or None) for x [M, K]: what dispatch runs instead of
    the kernel (Triton's dequantize + cuBLAS for weight-only, `_scaled_mm` for FP8, `_int_mm` + the epilogue for W8A8)."""
    import torch

    from quantspec import kernels

    def int_mm():
        xq, xs = kernels.quantize_act_int8(x, L.x_scale)
        return (torch._int_mm(xq, L.q8.t()).float() * xs[:, None] * L.s8[None, :]).to(L.dtype)

    cuda = x.device.type == "cuda"
    return {
        "w4a16": (lambda: kernels.w4a16_linear(x, L.w4, L.s4, L.group),
                  lambda: x @ kernels.w4a16_dequantize(L.w4, L.s4, L.group, L.K, None, L.dtype).t()),
        "w8a16": (lambda: kernels.w8a16_linear(x, L.q8, L.s8h),
                  lambda: x @ kernels.w8a16_dequantize(L.q8, L.s8, L.dtype).t()),
        "w8a16_fp8": (lambda: kernels.w8a16_linear(x, L.w_fp8, L.s8h),
                      lambda: x @ kernels.w8a16_dequantize(L.w_fp8, L.s8, L.dtype).t()),
        "w8a8": (lambda: kernels.w8a8_linear(x, L.q8, L.s8, L.x_scale), int_mm if cuda else None),
        "fp8": (lambda: kernels.fp8_linear(x, L.w_fp8, L.s8, L.x_scale_fp8),
                (lambda: kernels.fp8_scaled_mm_linear(x, L.w_fp8, L.s8, L.x_scale_fp8)) if cuda else None),
        "nvfp4": (lambda: kernels.nvfp4_linear(x, L.p4, L.sfp4, L.g4, None, L.g4x), None),  # W4A4
        "mxfp4": (lambda: kernels.mxfp4_linear(x, L.p4, L.smx, quantize_input=True), None),  # W4A4
    }


def flipped_ops(L: Layer, x) -> dict:
    """kind → the kernel under the other launch of its default. Weight-only: the other tile orientation
    (`W4A16Config.swap_ab` flipped, with the exact codes and the scale after each tile's MMA), or for a nibble-dots
    default the unpacking launch with the weight as the wide operand. W8A8 / FP8 where the default splits K: the
    same tiles unsplit. What chooses the launch per M."""
    from quantspec import kernels
    from quantspec.kernels._common import scaled_gemm_launch
    from quantspec.kernels.w4a16 import W4A16Config, w4a16_default_config, w4a16_linear
    from quantspec.kernels.w8a16 import w8a16_default_config, w8a16_linear

    M, gpu = x.shape[0], x.device.type == "cuda"
    c4 = w4a16_default_config(M, L.N, L.K, L.group, gpu)
    c8 = w8a16_default_config(M, L.N, L.K, gpu)
    c4, c8 = (W4A16Config(*c[:6], swap_ab=c[7] or not c[6]) for c in (c4, c8))
    ops = {"w4a16": lambda: w4a16_linear(x, L.w4, L.s4, L.group, config=c4),
           "w8a16": lambda: w8a16_linear(x, L.q8, L.s8h, config=c8)}
    launch = scaled_gemm_launch(M, L.N, L.K, gpu)
    if launch[-1] > 1:
        unsplit = launch[:-1] + (1,)

        def w8a8_unsplit():
            xq, xs = kernels.quantize_act_int8(x, L.x_scale)
            return kernels.int8_gemm(xq, xs, L.q8, L.s8, None, x.dtype, launch=unsplit)
        ops["w8a8"] = w8a8_unsplit
        ops["fp8"] = lambda: kernels.fp8_gemm(kernels.quantize_act_fp8(x, L.x_scale_fp8), L.x_scale_fp8, L.w_fp8,
                                              L.s8, None, x.dtype, launch=unsplit)
    return ops


def quartered_op(L: Layer, x):
    """W4A16 over the quartered layout (`w4a16.quarter_int4`, with its own launches), or None
    where K or the group size is not a multiple of 128."""
    from quantspec import kernels

    if L.w4q is None:
        return None
    return lambda: kernels.w4a16_linear(x, L.w4q, L.s4, L.group, quartered=True)


def dispatch_pick(kind: str, device, M: int, dtype):
    """→ (KernelPath, 'kernel' | 'alt' | None): what dispatch runs for this layer and call, and
    which measured column that is (None: a path this bench does not time)."""
    from quantspec.infer.dispatch import KernelPath, LinearKind, LinearTraits, select_kernel

    fp8_native = device.type == "cuda" and __import__("torch").cuda.get_device_capability(device) >= (8, 9)
    strategy = {"w4a16": "group", **FP4_KINDS}.get(kind, "channel")
    act_mode = "dynamic" if kind in FP4_KINDS else {"w8a8": "static", "fp8": "static"}.get(kind)
    linear_kind = LinearKind("fp4" if kind in FP4_KINDS else "fp8" if kind == "w8a16_fp8" else kind)
    traits = LinearTraits(kind=linear_kind, dtype=dtype, weight_symmetric=True,
                          weight_strategy=strategy, act_mode=act_mode, fp8_native=fp8_native, fp4_tiles=True)
    path = select_kernel(traits, device, M, dtype)
    if path.value.startswith("triton"):
        return path, "kernel"
    if path in (KernelPath.CUDA_DEQUANT_MM, KernelPath.CUDA_SCALED_MM):
        return path, "alt"
    return path, None


def _time_or_error(bench, fn):
    try:
        return bench(fn), None
    except Exception as e:  # noqa: BLE001 - a failing op is a table cell, not the end of the run
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def run_dtype(dtype_name: str, shapes, ms, device, bench) -> dict:
    import torch

    dtype = getattr(torch, DTYPE_NAMES[dtype_name])
    gen = torch.Generator(device=device).manual_seed(0)
    has_fp8 = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    rows = []
    for K, N in shapes:
        L = Layer(K, N, dtype, device, gen)
        for M in ms:
            x = torch.randn(M, K, device=device, generator=gen).to(dtype)
            t_ref, _ = _time_or_error(bench, lambda: x @ L.w.t())
            ops, flips = kernel_ops(L, x), flipped_ops(L, x)
            for kind in KINDS:
                if kind == "fp8" and not has_fp8:
                    continue
                kern, alt = ops[kind]
                t_k, err_k = _time_or_error(bench, kern)
                t_f, _ = _time_or_error(bench, flips[kind]) if kind in flips else (None, None)
                quartered = quartered_op(L, x) if kind == "w4a16" else None
                t_q = None if quartered is None else _time_or_error(bench, quartered)[0]
                t_a, err_a = (None, "n/a") if alt is None else _time_or_error(bench, alt)
                path, col = dispatch_pick(kind, device, M, dtype)
                t_d = {"kernel": t_k, "alt": t_a}.get(col)
                rows.append(dict(kind=kind, K=K, N=N, M=M, torch_ms=t_ref, kernel_ms=t_k, kernel_error=err_k,
                                 flipped_ms=t_f, quartered_ms=t_q, alt_ms=t_a, alt_error=err_a, dispatch=path.value,
                                 dispatch_ms=t_d))
            print(f"  {dtype_name} {K}x{N} M={M} done", flush=True)
    return {"dtype": dtype_name, "device": str(device), "rows": rows}


def _cell(t_ref, t, err=None) -> str:
    if t is None:
        return err or "—"
    return f"{t:.4f} ({t_ref / t:.2f}×)" if t_ref else f"{t:.4f}"


def markdown(result: dict) -> str:
    out = []
    for kind in KINDS:
        rows = [r for r in result["rows"] if r["kind"] == kind]
        if not rows:
            continue
        out.append(f"#### {kind.upper().replace('_', ' ')}, {result['dtype']} activations\n")
        quart = kind == "w4a16"
        out.append(f"| K×N | M | torch ms | Triton ms (×) | other launch ms (×) | "
                   f"{'quartered ms (×) | ' if quart else ''}{ALT_NAMES.get(kind, '—')} ms (×) | dispatch (×) |")
        out.append("|---|---|---|---|---|---|---|" + ("---|" if quart else ""))
        for r in rows:
            t = r["torch_ms"]
            d = f"{r['dispatch']} {_cell(t, r['dispatch_ms'])}" if r["dispatch_ms"] else r["dispatch"]
            q = f"{_cell(t, r.get('quartered_ms'))} | " if quart else ""
            out.append(f"| {r['K']}×{r['N']} | {r['M']} | {t:.4f} | {_cell(t, r['kernel_ms'], r['kernel_error'])} | "
                       f"{_cell(t, r.get('flipped_ms'))} | {q}{_cell(t, r['alt_ms'], r['alt_error'])} | {d} |")
        out.append("")
    return "\n".join(out)


def targets(result: dict) -> list[tuple[str, float | None, float, bool]]:
    """(what, measured ratio through dispatch, target, met) for the issue's kernel targets."""
    def ratio(kind, K, N, M):
        for r in result["rows"]:
            if (r["kind"], r["K"], r["N"], r["M"]) == (kind, K, N, M) and r["dispatch_ms"]:
                return r["torch_ms"] / r["dispatch_ms"]
        return None

    checks = [("W4A16 M=1 4096×14336", ratio("w4a16", 4096, 14336, 1), 3.0),
              ("W8A16 M=1 4096×14336", ratio("w8a16", 4096, 14336, 1), 1.8),
              ("W8A8 M=4096 4096×14336", ratio("w8a8", 4096, 14336, 4096), 1.5),
              ("FP8 M=4096 4096×14336", ratio("fp8", 4096, 14336, 4096), 1.5)]
    ratios = [r["torch_ms"] / r["dispatch_ms"] for r in result["rows"] if r["dispatch_ms"] and r["kind"] not in FP4_KINDS]
    checks.append(("lowest dispatch ratio, any cell", min(ratios) if ratios else None, 0.9))
    return [(w, v, t, v is not None and v >= t) for w, v, t in checks]


SWEEP_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
SWEEP_LARGE = ((4096, 14336), (256, 4096))  # the shape and the rows of the large-M sweep


def sweep_grid(kind: str, group: int, M: int = 1) -> list:
    """The `W4A16Config`s the sweep times for `kind` at M rows. Up to 16 rows: `tl.dot` tiles
    (BLOCK_M 16, split 2, 4 or 8, and 16 unswapped; swapped ones with the exact codes and with the
    scale folded in), W4A16's nibble dots, and for one row one-row programs (BLOCK_M 1,
    multiply-reduce); more rows: swapped tiles (W4A16's with the scale folded in), and the
    unswapped tile whose MMA waits for each dequantized tile.
    `fold_scale` only for W4A16: W8A16 has no per-tile scale."""
    from quantspec.kernels.w4a16 import W4A16Config

    bk = min(128, group)
    if M > 16:
        k64 = min(64, bk)
        tiles = [(64, 128, k64, 3), (128, 128, k64, 3), (128, 128, bk, 3), (128, 256, k64, 3), (128, 128, k64, 4),
                 (256, 128, k64, 3)]
        fold = kind == "w4a16"  # W8A16 scales once, at the end
        return [W4A16Config(bm, bn, k, 1, 8, st, True, False, fold) for bm, bn, k, st in tiles] + \
            [W4A16Config(128, 128, k64, 1, 8, 3)]
    nibs = (False, True) if kind == "w4a16" and bk >= 128 else (False,)
    dots = [(16, bn, bk, sk, False, nib, False) for bn in (64, 128) for sk in (2, 4, 8) for nib in nibs]
    # a split of 16 (past the heuristics' MAX_SPLIT_K) for the unswapped launch the default takes:
    # whether a launch whose columns give few tiles (K 14336, N 4096) gains from filling the SMs
    dots += [(16, bn, bk, 16, False, nibs[-1], False) for bn in (64, 128)]
    folds = (False, True) if kind == "w4a16" else (False,)
    dots += [(16, bn, bk, sk, True, False, fold) for bn in (64, 128) for sk in (2, 4, 8) for fold in folds]
    rows = []  # above one row, a one-row program per row would read the weight M times
    if M == 1 and kind == "w8a16":
        rows = [(1, bn, k, sk, False, False, False) for bn in (16, 32, 64) for k in (128, 256) for sk in (2, 4)]
    elif M == 1:
        rows = [(1, bn, bk, sk, False, nib, False) for bn in (16, 32, 64) for sk in (2, 4) for nib in nibs]
    return [W4A16Config(bm, bn, k, sk, 4, 3, swap, nib, fold) for bm, bn, k, sk, swap, nib, fold in dots + rows]


# W4A16's dequantize tiles (BLOCK_N, BLOCK_K, warps) besides the default's `w4a16.DEQUANT_BLOCK`:
# longer rows of k per tile (whole KB of each row written at once), fewer rows
DEQUANT_SWEEP = [(16, 256, 4), (8, 512, 4), (4, 1024, 4), (16, 512, 4), (8, 1024, 4), (16, 1024, 8), (32, 512, 8),
                 (64, 128, 4), (32, 256, 4), (64, 256, 8)]

# W8A8's large-M tiles besides the default's (128, 256, 128, 8 warps, 3 stages)
SCALED_SWEEP = [(128, 256, 128, 8, 4), (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (256, 128, 128, 8, 3),
                (128, 256, 64, 8, 4), (64, 256, 128, 4, 4)]


def _time_configs(bench, call, grid, found: list, record: dict, on_row) -> None:
    """Time `call()` (the default launch) and `call(cfg)` for each cfg of `grid`; append the
    record with the default's and the best time (every config's in `timed`)."""
    t_default, _ = _time_or_error(bench, call)
    best, timed = (t_default, "default"), {}
    for cfg in grid:
        t, _ = _time_or_error(bench, lambda: call(cfg))
        timed[",".join(map(str, cfg))] = t
        if t is not None and (best[0] is None or t < best[0]):
            best = (t, list(cfg))
    found.append(dict(record, default_ms=t_default, best_ms=best[0], best=best[1], timed=timed))
    print(f"  sweep {record['kind']} {record['K']}x{record['N']} M={record['M']}: default {t_default} best {best}",
          flush=True)
    if on_row is not None:
        on_row(found)


def sweep(shapes, device, bench, dtype_name: str, on_row=None) -> list[dict]:
    """Launch configs of W8A8's int8 GEMM at the largest M of `SWEEP_LARGE` (`SCALED_SWEEP`'s
    tiles, unsplit), of W4A16's dequantize on each shape (`DEQUANT_SWEEP`), then of W4A16 / W8A16 on the shape of `SWEEP_LARGE` at M ∈ {1, 16} and its
    large M, then at M ∈ {1, 16} on the other `shapes` (module docstring); `on_row(found)` after
    each (kind, shape, M), so that a time-boxed run keeps what it timed."""
    import torch

    from quantspec import kernels

    dtype = getattr(torch, DTYPE_NAMES[dtype_name])
    gen = torch.Generator(device=device).manual_seed(1)
    found = []
    shapes = [s for s in shapes if s in SWEEP_SHAPES] or shapes
    large_shape, large_ms = SWEEP_LARGE
    if device.type == "cpu":  # the interpreter: one large M proves that part runs
        large_ms = large_ms[:1]
    first = large_shape if large_shape in shapes else shapes[0]
    # the targets' shape first, every M, so that a time-boxed run has what matters most
    runs = [(first, M) for M in (1, 16, *large_ms)] + [(s, M) for s in shapes if s != first for M in (1, 16)]
    cpu = device.type == "cpu"  # the interpreter: two configs of each grid prove the sweep runs
    K, N = first
    L = Layer(K, N, dtype, device, gen)
    xq, xs = kernels.quantize_act_int8(torch.randn(large_ms[-1], K, device=device, generator=gen).to(dtype), L.x_scale)
    grid = [(16, 16, 32, 4, 1, 1), (16, 16, 32, 4, 1, 2)] if cpu else [t + (1,) for t in SCALED_SWEEP]
    _time_configs(bench, lambda cfg=None: kernels.int8_gemm(xq, xs, L.q8, L.s8, None, dtype, launch=cfg), grid,
                  found, dict(kind="w8a8", K=K, N=N, M=large_ms[-1]), on_row)
    for K, N in [first] + [s for s in shapes if s != first]:
        L = Layer(K, N, dtype, device, gen)
        _time_configs(bench, lambda cfg=None, L=L: kernels.w4a16_dequantize(L.w4, L.s4, L.group, L.K, None, dtype,
                                                                             block=cfg),
                      DEQUANT_SWEEP[:2] if cpu else DEQUANT_SWEEP, found, dict(kind="w4a16_dequant", K=K, N=N, M="—"),
                      on_row)
    for (K, N), M in runs:
        L = Layer(K, N, dtype, device, gen)
        x = torch.randn(M, K, device=device, generator=gen).to(dtype)
        for kind in ("w4a16", "w8a16"):
            def call(cfg=None):
                if kind == "w4a16":
                    return kernels.w4a16_linear(x, L.w4, L.s4, L.group, config=cfg)
                return kernels.w8a16_linear(x, L.q8, L.s8h, config=cfg)
            grid = sweep_grid(kind, L.group, M)
            _time_configs(bench, call, grid[:2] if cpu else grid, found, dict(kind=kind, K=K, N=N, M=M), on_row)
    return found


def _sweep_markdown(found: list[dict], name: str, dtype_name: str) -> str:
    md = [f"### Launch configs of the GEMM kernels on {name} ({dtype_name})\n",
          "| kernel | K×N | M | default ms | best ms | best (W4A16 / W8A16: BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, "
          "warps, stages, swap_ab, nibble_dots, fold_scale; W8A8: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, "
          "SPLIT_K; W4A16 dequantize: BLOCK_N, BLOCK_K, warps) |",
          "|---|---|---|---|---|---|"]
    for f in found:
        d = "—" if f["default_ms"] is None else f"{f['default_ms']:.4f}"
        b = "—" if f["best_ms"] is None else f"{f['best_ms']:.4f}"
        md.append(f"| {f['kind']} | {f['K']}×{f['N']} | {f['M']} | {d} | {b} | {f['best']} |")
    shared = _best_shared_small_m(found)
    if shared:
        md += ["", "Up to 16 rows one launch shape serves every M (a row's numbers do not depend on the "
               "other rows): the config with the least time over M = 1 and 16 together, beside the default's.\n",
               "| kernel | K×N | default ms (M = 1 + 16) | best ms (M = 1 + 16) | best |", "|---|---|---|---|---|"]
        md += [f"| {kind} | {K}×{N} | {d:.4f} | {b:.4f} | {cfg} |" for (kind, K, N), (d, b, cfg) in shared.items()]
    return "\n".join(md) + "\n"


def _best_shared_small_m(found: list[dict]) -> dict:
    """(kind, K, N) → (default's time, best time, best config) over M = 1 and 16 together, for
    the weight-only kernels timed at both (configs timed at both M only)."""
    out = {}
    for kind in ("w4a16", "w8a16"):
        for f1 in (f for f in found if f["kind"] == kind and f["M"] == 1):
            f16 = next((f for f in found if (f["kind"], f["K"], f["N"], f["M"]) == (kind, f1["K"], f1["N"], 16)), None)
            if f16 is None or f1["default_ms"] is None or f16["default_ms"] is None:
                continue
            both = {c: t + f16["timed"][c] for c, t in f1["timed"].items()
                    if t is not None and f16["timed"].get(c) is not None}
            d = f1["default_ms"] + f16["default_ms"]
            best = min(both.items(), key=lambda kv: kv[1], default=None)
            out[(kind, f1["K"], f1["N"])] = (d, d, "default") if best is None or best[1] >= d else \
                (d, best[1], "[" + best[0] + "]")
    return out


def _sweep_main(shapes, device, bench, dtype_name: str, name: str, out: Path | None) -> int:
    if device.type == "cuda":  # many configs: fewer repeats
        bench = lambda fn: gpu_time(fn, reps=10)  # noqa: E731

    def write(found):
        if out:
            (out / "kernels_sweep.md").write_text(_sweep_markdown(found, name, dtype_name))
            (out / "kernels_sweep.json").write_text(json.dumps(found, indent=1))
    found = sweep(shapes, device, bench, dtype_name, on_row=write)
    print(_sweep_markdown(found, name, dtype_name))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", default=None, help="comma-separated fp16,bf16 (default: both on CUDA, fp32 on CPU)")
    ap.add_argument("--m", default=None, help="comma-separated rows M (default 1,16,64,256,4096; CPU 1,16)")
    ap.add_argument("--out", default=None, help="folder for kernels_<dtype>.md / .json")
    ap.add_argument("--sweep-only", action="store_true", help="time grids of W8A8 / W4A16 / W8A16 launch configs")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA GPU here; pass --device cpu for the interpreter smoke run", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    shapes = CPU_SHAPES if cpu else GPU_SHAPES
    ms = [int(m) for m in (args.m or ("1,16" if cpu else "1,16,64,256,4096")).split(",")]
    dtypes = (args.dtype or ("fp32" if cpu else "fp16,bf16")).split(",")
    bench = _timer(device)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if not cpu else "CPU (Triton interpreter)"
    if args.sweep_only:
        return _sweep_main(shapes, device, bench, dtypes[0], name, out)
    for dt in dtypes:
        result = run_dtype(dt, shapes, ms, device, bench)
        result["gpu"] = name
        result["targets"] = targets(result)
        md = f"### Kernels vs torch {dt} matmul on {name}\n\n" + markdown(result)
        md += "\n| target (through dispatch) | measured | target | met |\n|---|---|---|---|\n" + "\n".join(
            f"| {w} | {'—' if v is None else f'{v:.2f}×'} | ≥ {t}× | {'yes' if ok else 'no'} |"
            for w, v, t, ok in result["targets"]) + "\n"
        print(md, flush=True)
        if out:
            (out / f"kernels_{dt}.md").write_text(md)
            (out / f"kernels_{dt}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
