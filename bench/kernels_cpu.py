"""quantspec's CPU GEMM kernels vs the torch ops they replace, side by side in one run.

    python bench/kernels_cpu.py [--threads 2] [--rows 1,2,4,8,16,64,128] [--rate-rows 1,4,8,11,16,130]
                                [--prefill-rows 130,512] [--pair-rows 1,4,11,130]

Weights of the default model's shapes (30 decoder layers: fused q/k/v 960×576, o 576×576, fused
gate/up 3072×576, down 576×1536; and the 49152×576 head), cycled so that they stream from memory
as in a decode step. For each weight type and number of rows M: milliseconds per pass over all
layers (or per head call) for torch's op and for quantspec's kernel, and the ratio.
torch's ops: fp32 `mm(W, xᵀ)` (the skinny path of infer/cpu/linears.py) for M ≤ 4 and
`F.linear` above, bf16 `F.linear`, int8 `_weight_int8pack_mm` (bf16 x), int4
`_weight_int4pack_mm_for_cpu` (bf16 x, g32), NVFP4 `F.linear` on the weight dequantized to bf16
(the path without quantspec's kernels). quantspec's: `packed_gemm` (fp32, column blocks),
`packed_pairs_gemm` (bf16 in k-pairs; `dense_gemv`, row-major, without AVX512-BF16),
`packed_w8_gemm`, `packed_w4_gemm`, `packed_fp4_gemm` (NVFP4's groups of 16; bf16 x: their pair path).

Compute-rate table (`--rate-rows`): GFLOP/s of `packed_gemm` over the fp32 layers at M rows beside
torch's sgemm on a large square product (2048³, the machine's practical fp32 peak): where the
packed kernel is near that rate, a verification step of M rows cannot get cheaper in fp32 here.

Pair-path table (`--pair-rows`): bf16 x (how quantized artifacts load on CPU) through the int8 /
int4 layers and the bf16 head: the kernels' AVX512-BF16 pair path (what runs) vs their fp32 chain
(`pairs=False`; for the head the row-major `dense_gemv`) and torch's op.

Attention table (`--attention-rows`, `--context`): `paged_attention` over the default model's 30
layers (9 query heads, 3 KV heads, head dim 64, a cache per layer), one sequence whose last M
rows are new: M = 1 a decode step, 11 a 10-draft verification (both over `--context` keys), more
a fresh prompt of M tokens; torch's SDPA on the same rows (causal, fp32 and bf16), the kernel in
fp32 (fresh prompts of 16+ tokens: its blocked prefill path, queries on the vector lanes; beside
it the per-row path of decode steps, `prefill_blocks=False`), and bf16 through its fp32 chain
(`pairs=False`) and its pair path.

Prefill table (`--prefill-rows`): fp32 x (how the default model loads) through the int8 / int4
(g64) layers, where the dispatch took dequantize + `F.linear` before quantspec's packed kernels
served every M: that path vs the packed kernel, per pass over all layers.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from quantspec.kernels import cpu as cg
from quantspec.quant.fp4 import e2m1_codes

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def _time(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def _counts(arg: str, opt: str) -> list[int]:
    """'1,11,130' → [1, 11, 130] ('' → none); anything else is one error line"""
    try:
        counts = [int(r) for r in arg.split(",") if r]
    except ValueError:
        counts = [0]
    if any(c < 1 for c in counts):
        raise SystemExit(f"{opt} {arg!r}: give comma-separated row counts >= 1, or '' to skip")
    return counts


def _skinny_fp32(x, w):
    if x.shape[0] > 4:
        return F.linear(x, w)
    x2 = torch.cat([x, x.new_zeros(1, x.shape[1])]) if x.shape[0] == 1 else x
    return torch.mm(w, x2.t()).t()[: x.shape[0]].contiguous()


def _make(kind: str, N: int, K: int):
    w = torch.randn(N, K) * 0.05
    if kind == "fp32":
        return (w,), (cg.pack_dense(w), N)
    if kind == "bf16":
        wb = w.bfloat16()
        return (wb,), ((cg.pack_pairs(wb), N) if cg.pair_path_available() else (wb,))
    if kind == "int8":
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        s = torch.rand(N) * 0.01
        return (q, s.bfloat16()), (cg.pack_w8(q), s, N)
    if kind == "nvfp4":
        nib = torch.randint(0, 16, (N, K), dtype=torch.uint8)
        s = torch.rand(N, K // 16) * 0.01
        w = e2m1_codes(nib).float() * s.repeat_interleave(16, 1)
        return (w.bfloat16(),), (*cg.pack_fp4_blocks(nib, s), 16, N)
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8)
    g = 32
    s = torch.rand(N, K // g) * 0.01
    z = torch.zeros_like(s)
    tp = torch._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
    sz = torch.stack([s.t(), z.t()], dim=-1).bfloat16().contiguous()
    return (tp, g, sz), (*cg.pack_w4(q, s, z), g, N)


def _torch_op(kind: str):
    return {
        "fp32": lambda x, w: _skinny_fp32(x, w),
        "bf16": lambda x, w: F.linear(x, w),
        "int8": lambda x, q, s: torch._weight_int8pack_mm(x, q, s),
        "int4": lambda x, tp, g, sz: torch._weight_int4pack_mm_for_cpu(x, tp, g, sz),
        "nvfp4": lambda x, w: F.linear(x, w),
    }[kind]


def _ours(kind: str):
    bf16 = cg.packed_pairs_gemm if cg.pair_path_available() else cg.dense_gemv
    return {"fp32": cg.packed_gemm, "bf16": bf16, "int8": cg.packed_w8_gemm, "int4": cg.packed_w4_gemm,
            "nvfp4": cg.packed_fp4_gemm}[kind]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rows", default="1,2,4,8,16,64,128")
    ap.add_argument("--kinds", default="fp32,bf16,int8,int4,nvfp4")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rate-rows", default="1,4,8,11,16,130", help="rows of the compute-rate table ('' skips it)")
    ap.add_argument("--prefill-rows", default="130,512", help="rows of the prefill table ('' skips it)")
    ap.add_argument("--pair-rows", default="1,4,11,130", help="rows of the pair-path table ('' skips it)")
    ap.add_argument("--attention-rows", default="1,11,130,1024",
                    help="query rows of the attention table ('' skips it)")
    ap.add_argument("--context", type=int, default=266, help="keys of a decode / verification row (attention table)")
    a = ap.parse_args()
    rows = _counts(a.rows, "--rows")
    rate_rows, prefill = _counts(a.rate_rows, "--rate-rows"), _counts(a.prefill_rows, "--prefill-rows")
    pair_rows, attention_rows = _counts(a.pair_rows, "--pair-rows"), _counts(a.attention_rows, "--attention-rows")
    if a.context < 1:
        raise SystemExit(f"--context {a.context}: give 1 or more keys")
    if a.threads:
        torch.set_num_threads(a.threads)
    if cg.cpu_kernels() is None:
        raise SystemExit(f"quantspec CPU kernels unavailable: {cg.cpu_kernels_error()}")
    kinds = [k for k in a.kinds.split(",") if k]
    if kinds and rows:
        gemm_table(kinds, rows, a.layers)
    if rate_rows:
        rate_table(rate_rows, a.layers)
    if prefill:
        prefill_table([k for k in kinds if k in ("int8", "int4")], prefill, a.layers)
    if pair_rows:
        pair_table(pair_rows, a.layers)
    if attention_rows:
        attention_table(attention_rows, a.layers, a.context)


def gemm_table(kinds: list[str], rows: list[int], n_layers: int) -> None:
    """ms per pass over the layers / per head call: torch's op vs quantspec's, by weight type and M."""
    print(f"\n## CPU GEMMs, {torch.get_num_threads()} threads (ms; ratio = torch / quantspec)\n")
    print("| weights | M | layers: torch | layers: quantspec | ratio | head: torch | head: quantspec | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        xdtype = torch.float32 if kind == "fp32" else torch.bfloat16
        layers = [(K, *_make(kind, N, K)) for N, K in LAYER_SHAPES * n_layers]
        head = _make(kind, *HEAD)
        theirs, ours = _torch_op(kind), _ours(kind)
        for M in rows:
            xs = {K: torch.randn(M, K).to(xdtype) for K in (576, 1536)}
            reps = 5 if M <= 16 else 2
            t_l = _time(lambda: [theirs(xs[K], *tt) for K, tt, _ in layers], reps)
            o_l = _time(lambda: [ours(xs[K], *oo) for K, _, oo in layers], reps)
            t_h = _time(lambda: theirs(xs[576], *head[0]), reps)
            o_h = _time(lambda: ours(xs[576], *head[1]), reps)
            print(f"| {kind} | {M} | {t_l:.2f} | {o_l:.2f} | {t_l / o_l:.2f}x | {t_h:.2f} | "
                  f"{o_h:.2f} | {t_h / o_h:.2f}x |", flush=True)


def rate_table(rows: list[int], n_layers: int) -> None:
    """GFLOP/s of `packed_gemm` over the fp32 layers at M rows beside torch's large square sgemm."""
    big = torch.randn(2048, 2048)
    t_big = _time(lambda: torch.mm(big, big), 3)
    peak = 2 * 2048 ** 3 / t_big / 1e6  # GFLOP/s
    print(f"\n## fp32 compute rate, {torch.get_num_threads()} threads (GFLOP/s)\n")
    print(f"torch.mm 2048 x 2048 x 2048: {peak:.0f} GFLOP/s\n")
    print("| M | packed_gemm over the layers | share of torch.mm's rate |")
    print("|---:|---:|---:|")
    layers = [(K, cg.pack_dense(torch.randn(N, K) * 0.05), N) for N, K in LAYER_SHAPES * n_layers]
    flop_per_row = sum(2 * N * K for K, _, N in layers)
    for M in rows:
        xs = {K: torch.randn(M, K) for K in (576, 1536)}
        t = _time(lambda: [cg.packed_gemm(xs[K], w, N) for K, w, N in layers], 3)
        rate = M * flop_per_row / t / 1e6
        print(f"| {M} | {rate:.0f} | {rate / peak:.0%} |", flush=True)


def prefill_table(kinds: list[str], rows: list[int], n_layers: int) -> None:
    """fp32 x through the int8 / int4 layers: dequantize + F.linear vs the packed kernel."""
    print(f"\n## Prefill through quantized layers, fp32 x, {torch.get_num_threads()} threads "
          "(ms per pass; ratio = dequantize + matmul / packed kernel)\n")
    print("| weights | M | dequantize + F.linear | packed kernel | ratio |")
    print("|---|---:|---:|---:|---:|")
    for kind in kinds:
        layers = [(K, *_prefill_layer(kind, N, K)) for N, K in LAYER_SHAPES * n_layers]
        for M in rows:
            xs = {K: torch.randn(M, K) for K in (576, 1536)}
            t_d = _time(lambda: [d(xs[K]) for K, d, _ in layers], 2)
            t_o = _time(lambda: [o(xs[K]) for K, _, o in layers], 2)
            print(f"| {kind} | {M} | {t_d:.1f} | {t_o:.1f} | {t_d / t_o:.2f}x |", flush=True)


def attention_table(rows: list[int], n_layers: int, context: int) -> None:
    """µs per layer (over n_layers caches, so they stream from L2 / L3 as in a step)"""
    H, KV, hd, bs = 9, 3, 64, 16
    print(f"\n## Paged attention, {torch.get_num_threads()} threads (µs a layer; H {H}, KV {KV}, head dim {hd}; "
          f"decode / verification rows over {context} keys, prefill rows over themselves)\n")
    if not cg.pair_path_available():
        print("(this CPU has no AVX512-BF16: the 'bf16 pairs' column runs the fp32 chain too)\n")
    print("| rows | keys | torch SDPA fp32 | fp32 | fp32 per-row | per-row / fp32 | SDPA / fp32 | torch SDPA bf16 "
          "| bf16 chain | bf16 pairs | chain / pairs | SDPA / pairs |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for M in rows:
        L = max(context, M) if M <= 16 else M
        nb = (L + bs - 1) // bs
        table = torch.arange(nb).view(1, nb)
        slots = torch.arange(L - M, L)
        mask = torch.ones(M, L, dtype=torch.bool).tril(L - M)
        res = {}
        for dt in (torch.float32, torch.bfloat16):
            caches = [(torch.randn(nb * bs, KV, hd).to(dt), torch.randn(nb * bs, KV, hd).to(dt)) for _ in range(n_layers)]
            q = torch.randn(M, H, hd).to(dt)
            k, v = torch.randn(M, KV, hd).to(dt), torch.randn(M, KV, hd).to(dt)

            def ours(**settings):
                for kc, vc in caches:
                    cg.paged_attention(q, k, v, kc, vc, slots, table, [M], [L], bs, hd ** -0.5, **settings)

            qq = q.transpose(0, 1).unsqueeze(0)

            def sdpa():
                for kc, vc in caches:  # a contiguous cache: no block-table gather for torch
                    kk, vv = kc[:L].transpose(0, 1).unsqueeze(0), vc[:L].transpose(0, 1).unsqueeze(0)
                    F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=hd ** -0.5, enable_gqa=True)

            reps = 20 if M <= 16 else 3
            if dt == torch.float32:
                res["fp32"] = _time(ours, reps)
                res["rows"] = _time(lambda: ours(prefill_blocks=False), reps)
                res["sdpa32"] = _time(sdpa, reps)
                continue
            res["chain"] = _time(lambda: ours(pairs=False), reps)
            res["pairs"] = _time(ours, reps)
            res["sdpa"] = _time(sdpa, reps)
        us = {key: t * 1e3 / n_layers for key, t in res.items()}
        print(f"| {M} | {L} | {us['sdpa32']:.1f} | {us['fp32']:.1f} | {us['rows']:.1f} | {us['rows'] / us['fp32']:.2f}x | "
              f"{us['sdpa32'] / us['fp32']:.2f}x | {us['sdpa']:.1f} | {us['chain']:.1f} | {us['pairs']:.1f} | "
              f"{us['chain'] / us['pairs']:.2f}x | {us['sdpa'] / us['pairs']:.2f}x |", flush=True)


def pair_table(rows: list[int], n_layers: int) -> None:
    """bf16 x through the quantized layers and the bf16 head: quantspec's pair path (AVX512-BF16's
    dot product) vs the same kernels' fp32 chain (`pairs=False`) and torch's packed op, side by
    side; int4 in groups of 64 (what the default model's int4 artifact uses for K = 576)."""
    if not cg.pair_path_available():
        print("\n(no pair-path table: this CPU has no AVX512-BF16)")
        return
    print(f"\n## bf16 x: pair path vs fp32 chain, {torch.get_num_threads()} threads (ms per pass over "
          f"{n_layers} layers / per head call; ratio = chain / pairs)\n")
    print("| weights | M | torch's op | fp32 chain | pair path | ratio | vs torch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    g = 64
    cases = {}
    for kind in ("int8", "int4"):
        layers = []
        for N, K in LAYER_SHAPES * n_layers:
            if kind == "int8":
                q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
                s = torch.rand(N) * 0.01
                pq, sb = cg.pack_w8(q), s.bfloat16()
                layers.append((K, lambda x, q=q, sb=sb: torch._weight_int8pack_mm(x, q, sb),
                               lambda x, pq=pq, s=s, N=N, pairs=True: cg.packed_w8_gemm(x, pq, s, N, pairs=pairs)))
            else:
                q = torch.randint(-8, 8, (N, K), dtype=torch.int8)
                s = torch.rand(N, K // g) * 0.01
                z = torch.zeros_like(s)
                tp = torch._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
                sz = torch.stack([s.t(), z.t()], dim=-1).bfloat16().contiguous()
                p4 = cg.pack_w4(q, s, z)
                layers.append((K, lambda x, tp=tp, sz=sz: torch._weight_int4pack_mm_for_cpu(x, tp, g, sz),
                               lambda x, p4=p4, N=N, pairs=True: cg.packed_w4_gemm(x, *p4, g, N, pairs=pairs)))
        cases[kind] = (lambda xs, L=layers: [t(xs[K]) for K, t, _ in L],
                       lambda xs, L=layers, pairs=True: [o(xs[K], pairs=pairs) for K, _, o in L])
    wb = (torch.randn(*HEAD) * 0.05).bfloat16()
    wp = cg.pack_pairs(wb)
    cases["bf16 head"] = (lambda xs: F.linear(xs[576], wb),
                          lambda xs, pairs=True: (cg.packed_pairs_gemm(xs[576], wp, HEAD[0]) if pairs
                                                  else cg.dense_gemv(xs[576], wb)))  # row-major: its fp32 chain
    for kind, (theirs, ours) in cases.items():
        for M in rows:
            xs = {K: torch.randn(M, K).bfloat16() for K in (576, 1536)}
            reps = 5 if M <= 16 else 2
            t_t = _time(lambda: theirs(xs), reps)
            t_c = _time(lambda: ours(xs, pairs=False), reps)
            t_p = _time(lambda: ours(xs), reps)
            print(f"| {kind} | {M} | {t_t:.2f} | {t_c:.2f} | {t_p:.2f} | {t_c / t_p:.2f}x | {t_t / t_p:.2f}x |", flush=True)


def _prefill_layer(kind: str, N: int, K: int, g: int = 64):
    """(dequantize, then an fp32 matmul; quantspec's packed kernel) for one int8 (per channel) or
    int4 (groups of g: 64 divides every K of the default model) layer."""
    if kind == "int8":
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        s = torch.rand(N) * 0.01
        pq = cg.pack_w8(q)
        return (lambda x: F.linear(x, q.float() * s[:, None])), (lambda x: cg.packed_w8_gemm(x, pq, s, N))
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8)
    s = torch.rand(N, K // g) * 0.01
    p4 = cg.pack_w4(q, s, torch.zeros_like(s))
    return ((lambda x: F.linear(x, (q.float().view(N, -1, g) * s[..., None]).view(N, K))),
            (lambda x: cg.packed_w4_gemm(x, *p4, g, N)))

if __name__ == "__main__":
    main()
