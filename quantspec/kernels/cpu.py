"""CPU skinny-GEMM kernels for decode and verification steps (`csrc/cpu.cpp`), each beside
a torch reference (`*_ref`) with the same signature.

`y = x @ Wᵀ (+ b)` for a few rows of x (fp32 or bf16) over fp32 / bf16 / int8 (per-channel
scale) / int4 (group scale, optional zero point) weights, streaming each weight row once per
tile of x rows and dequantizing in registers. On the default model's shapes (2 cores, AVX-512)
they run at the memory bandwidth where torch's CPU ops do not: `_weight_int8pack_mm` reads
int8 weights at ~12 G weights/s, a bf16 `linear` of the 49k-row head at ~12 GB/s; see
`bench/kernels_cpu.py`. Every output element is computed by the same float operations whatever
the number of rows (tiles never change a row's reduction order), so verification rows equal
decode rows bitwise.

`paged_attention` writes a step's keys / values into the paged cache and attends each new query
row (decode: one per sequence; verification: 1 + k) over exactly its sequence's keys up to its
position, reading the cache through the block table: one call per layer for the whole batch,
where torch's SDPA costs ~150 µs per sequence and layer for one query row. Each query's numbers
depend only on its own keys, so decode and verification agree bitwise here too.

The extension is compiled at first use with `torch.utils.cpp_extension` (the machine's C++
compiler, `-march=native`) into the quantspec cache, keyed by the source, torch's version and
the CPU; a later process loads it in milliseconds. Without a compiler, without AVX-512, or with
`QUANTSPEC_CPU_KERNELS=0`, `cpu_kernels()` returns None and callers keep torch's ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "ENV_SWITCH",
    "X_DTYPES",
    "cpu_kernels",
    "cpu_kernels_error",
    "dense_gemv",
    "dense_gemv_ref",
    "pack_dense",
    "packed_gemm",
    "packed_gemm_ref",
    "unpack_dense",
    "paged_attention",
    "paged_attention_ref",
    "pack_int4_cpu",
    "unpack_int4_cpu",
    "w4_gemv",
    "w4_gemv_ref",
    "w8_gemv",
    "w8_gemv_ref",
]

ENV_SWITCH = "QUANTSPEC_CPU_KERNELS"  # "0": never build or use them
X_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes every kernel takes
K_MULTIPLE = 16  # the kernels take K % 16 == 0 (int4: K % 32 == 0, groups of a multiple of 32)
INT4_BLOCK = 32
PACK_BLOCK = 32  # output features per column block of `pack_dense`

_SOURCE = Path(__file__).parent / "csrc" / "cpu.cpp"
# no fused multiply-adds the compiler picks per call site: a row's numbers must not depend on
# how many rows a tile holds
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_log = logging.getLogger("quantspec")
_lock = threading.Lock()
_state: dict = {"tried": False, "module": None, "error": None}


def _cpu_signature() -> str:
    """The CPU's model and flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _build_key() -> str:
    h = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_CFLAGS).encode(), torch.__version__.encode(),
                 sys.version.encode(), _cpu_signature().encode()):
        h.update(part)
    return h.hexdigest()[:16]


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    from quantspec.model_zoo.default import cache_dir

    key = _build_key()
    build_dir = cache_dir() / "ext" / f"cpu-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        _log.warning("quantspec: compiling the CPU kernels for this machine (once, ~30 s)")
    return load(name=f"quantspec_cpu_{key}", sources=[str(_SOURCE)],
                extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir), verbose=False)


def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None where it cannot run (the reason: `cpu_kernels_error()`)."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if _state["tried"]:
            return _state["module"]
        module, error = None, None
        if os.environ.get(ENV_SWITCH, "1") == "0":
            error = f"disabled by {ENV_SWITCH}=0"
        elif platform.machine().lower() not in ("x86_64", "amd64"):
            error = f"needs an x86-64 CPU with AVX-512, this is {platform.machine()}"
        else:
            try:
                module = _build()
                if not module.has_avx512():
                    module, error = None, "this CPU has no AVX-512 (F + BW)"
            except Exception as e:  # no compiler, failed build: torch's ops still work
                error = f"could not build them: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
                _log.warning("quantspec: CPU kernels unavailable (%s); using torch's ops "
                             "(set %s=0 to skip the build)", error, ENV_SWITCH)
        _state.update(tried=True, module=module, error=error)
        return module


def cpu_kernels_error() -> str | None:
    """Why `cpu_kernels()` is None (None when it is available or was not asked for yet)."""
    return _state["error"]


def _need() -> ModuleType:
    mod = cpu_kernels()
    if mod is None:
        raise RuntimeError(f"quantspec CPU kernels unavailable: {cpu_kernels_error()}")
    return mod


# ---- ops -----------------------------------------------------------------------------------

def dense_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16 contiguous, w [N, K] fp32/bf16, bias [N] fp32 → [M, N] in x.dtype."""
    return _need().dense_gemv(x, w, bias)


def dense_gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    return (y if bias is None else y + bias).to(x.dtype)


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """fp32 weight [N, K] → [NB, K, 32] column blocks (NB = ceil(N / 32), N zero-padded):
    block b holds w[32 b + j, k] at [b, k, j]. Done once at load; `packed_gemm` reads it."""
    N, K = w.shape
    nb = -(-N // PACK_BLOCK)
    padded = torch.zeros(nb * PACK_BLOCK, K, dtype=torch.float32)
    padded[:N] = w.detach()
    return padded.view(nb, PACK_BLOCK, K).transpose(1, 2).contiguous()


def unpack_dense(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_dense` → [n, K]."""
    nb, K, _ = packed.shape
    return packed.transpose(1, 2).reshape(nb * PACK_BLOCK, K)[:n].contiguous()


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16 contiguous (any M), packed from `pack_dense` of a [n, K] fp32 weight,
    bias [n] fp32 → [M, n] in x.dtype."""
    return _need().packed_gemm(x, packed, n, bias)


def packed_gemm_ref(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ unpack_dense(packed, n).t()
    return (y if bias is None else y + bias).to(x.dtype)


def w8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], q [N, K] int8, scale [N] fp32 (per output channel), bias [N] fp32 → [M, N]."""
    return _need().w8_gemv(x, q, scale, bias)


def w8_gemv_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    y = (x.float() @ q.float().t()) * scale[None, :]
    return (y if bias is None else y + bias).to(x.dtype)


def pack_int4_cpu(q: torch.Tensor) -> torch.Tensor:
    """int4 codes q [N, K] (int8 in [-8, 7], K % 32 == 0) → uint8 [N, K/2]: per 32-wide block of
    k, byte j holds q[j] + 8 in its low nibble and q[j + 16] + 8 in its high nibble."""
    N, K = q.shape
    if K % INT4_BLOCK:
        raise ValueError(f"pack_int4_cpu: K={K} is not a multiple of {INT4_BLOCK}")
    u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(N, K // INT4_BLOCK, 2, 16)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


def unpack_int4_cpu(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4_cpu` → int8 codes [N, K]."""
    N, half = packed.shape
    p = packed.reshape(N, half // 16, 1, 16)
    u = torch.cat([p & 0x0F, p >> 4], dim=2)  # [N, K/32, 2, 16]
    return (u.to(torch.int16) - 8).to(torch.int8).reshape(N, half * 2)


def w4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, neg_zs: torch.Tensor,
            group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K]; packed [N, K/2] (`pack_int4_cpu`); scale, neg_zs [N, K/group] fp32 with
    w = q·scale + neg_zs (neg_zs = −zp·scale; zeros when symmetric) → [M, N] in x.dtype."""
    return _need().w4_gemv(x, packed, scale, neg_zs, group, bias)


def w4_gemv_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, neg_zs: torch.Tensor,
                group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    q = unpack_int4_cpu(packed).float()
    w = q * scale.repeat_interleave(group, dim=1) + neg_zs.repeat_interleave(group, dim=1)
    y = x.float() @ w.t()
    return (y if bias is None else y + bias).to(x.dtype)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    q_lens: list[int], seq_lens: list[int], block_size: int, scale: float) -> torch.Tensor:
    """q [T, H, hd] (sequence b's q_lens[b] rows in order; fp32/bf16, hd 64 or 128); k_new, v_new
    [T, KV, hd] are written to k_cache, v_cache [slots, KV, hd] at slot_mapping [T]; then row i
    of sequence b (position seq_lens[b] − q_lens[b] + i) attends over its keys 0..position,
    found through block_tables [B, nb] → out [T, H, hd] (query head h reads KV head h // (H/KV))."""
    return _need().paged_attention(q, k_new, v_new, k_cache, v_cache, slot_mapping, block_tables,
                                   list(q_lens), list(seq_lens), block_size, scale)


def paged_attention_ref(q, k_new, v_new, k_cache, v_cache, slot_mapping, block_tables, q_lens,
                        seq_lens, block_size, scale) -> torch.Tensor:
    k_cache[slot_mapping] = k_new
    v_cache[slot_mapping] = v_new
    H, KV = q.shape[1], k_cache.shape[1]
    out, row = torch.empty_like(q), 0
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(sl)
        slots = block_tables[b][pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(H // KV, dim=1)  # [sl, H, hd]
        v = v_cache[slots].float().repeat_interleave(H // KV, dim=1)
        for i in range(ql):
            L = sl - ql + i + 1
            w = torch.softmax(torch.einsum("hd,lhd->hl", q[row + i].float() * scale, k[:L]), dim=-1)
            out[row + i] = torch.einsum("hl,lhd->hd", w, v[:L]).to(q.dtype)
        row += ql
    return out
