"""quantspec's CPU kernels (`csrc/cpu.cpp`), each beside a torch reference (`*_ref`) with the
same signature.

`y = x @ Wᵀ (+ b)` for rows of x (fp32 or bf16): `packed_gemm` / `packed_w8_gemm` /
`packed_w4_gemm` over fp32 / int8 (per-channel scale) / int4 (group scale, optional zero point)
weights repacked once into column blocks of 32 outputs (`pack_dense`, `pack_w8`, `pack_w4`), any
number of rows (decode, verification, prefill), dequantizing in registers; `dense_gemv` over
row-major fp32 / bf16 weights for a few rows (the bf16 head of an artifact where the CPU lacks
AVX512-BF16); `packed_pairs_gemm` over a bf16 weight packed in k-pairs (`pack_pairs`) for bf16 x,
and the int8 / int4 GEMMs' pair path for bf16 x, through AVX512-BF16's dot product. On the default
model's shapes (2 cores, AVX-512) the packed fp32 GEMM runs 8 rows 2.5-3.0x faster than torch
and prefill 1.5-1.7x faster than torch's sgemm; see `bench/kernels_cpu.py`.
Every output element is computed by the same float operations whatever the number of rows, so
verification rows equal decode rows bitwise.

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

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
import time
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
    "pack_w4",
    "pack_pairs",
    "pack_w8",
    "pack_w8_pairs",
    "unpack_w8",
    "unpack_w8_pairs",
    "packed_w4_gemm",
    "packed_w4_gemm_ref",
    "packed_w8_gemm",
    "packed_w8_gemm_ref",
    "packed_gemm",
    "packed_gemm_ref",
    "packed_pairs_gemm",
    "packed_pairs_gemm_ref",
    "pair_path_available",
    "prefetch",
    "unpack_pairs",
    "unpack_dense",
    "paged_attention",
    "paged_attention_ref",
    "silu_mul",
    "silu_mul_ref",
]

ENV_SWITCH = "QUANTSPEC_CPU_KERNELS"  # "0": never build or use them
X_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes every kernel takes
K_MULTIPLE = 16  # `dense_gemv` takes K % 16 == 0 (the packed kernels take any K)
PACK_BLOCK = 32  # output features per column block of `pack_dense`

_SOURCE = Path(__file__).parent / "csrc" / "cpu.cpp"
# no fused multiply-adds the compiler picks per call site: a row's numbers must not depend on
# how many rows a tile holds
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_STALE_LOCK_S = 600  # a build takes ~30 s: a lock older than this belongs to a killed build
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

    from quantspec.paths import cache_dir

    key = _build_key()
    build_dir = cache_dir() / "ext" / f"cpu-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # compile a copy inside the build directory: the build is keyed by the source's content, and
    # every checkout or install with that content then shares one build (ninja would rebuild
    # whenever the source's path changed)
    source = build_dir / _SOURCE.name
    if not source.is_file() or source.read_bytes() != _SOURCE.read_bytes():
        from quantspec.outputs import write_text

        write_text(source, _SOURCE.read_text())
    lock = build_dir / "lock"  # torch's build lock: a build killed midway leaves it behind forever
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    if not any(build_dir.glob("*.so")):
        _log.warning("quantspec: compiling the CPU kernels for this machine (once, ~30 s)")
    return load(name=f"quantspec_cpu_{key}", sources=[str(source)],
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


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, C] → [NB, C, 32]: rows in blocks of 32 (N zero-padded), each block transposed."""
    N, C = t.shape
    nb = -(-N // PACK_BLOCK)
    padded = t.detach()
    if N % PACK_BLOCK:  # (else no padded copy: a 49k-row head packs with one new tensor)
        padded = torch.zeros(nb * PACK_BLOCK, C, dtype=t.dtype)
        padded[:N] = t.detach()
    return padded.reshape(nb, PACK_BLOCK, C).transpose(1, 2).contiguous()


def _unblock(t: torch.Tensor, n: int) -> torch.Tensor:
    nb, C, _ = t.shape
    return t.transpose(1, 2).reshape(nb * PACK_BLOCK, C)[:n].contiguous()


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """fp32 weight [N, K] → [NB, K, 32] column blocks (NB = ceil(N / 32), N zero-padded):
    block b holds w[32 b + j, k] at [b, k, j]. Done once at load; `packed_gemm` reads it."""
    return _blocks(w.float())


def unpack_dense(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_dense` → [n, K]."""
    return _unblock(packed, n)


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16 contiguous (any M), packed from `pack_dense` of a [n, K] fp32 weight,
    bias [n] fp32 → [M, n] in x.dtype."""
    return _need().packed_gemm(x, packed, n, bias)


def packed_gemm_ref(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ unpack_dense(packed, n).t()
    return (y if bias is None else y + bias).to(x.dtype)


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """Float [N, K] (K even) → int32 [NB, K/2, 32]: block b, k-pair p, output j holds
    bf16(w[32b + j, 2p]) in its low half and bf16(w[32b + j, 2p + 1]) in its high half (zero rows
    pad N): the operand of AVX512-BF16's dot product (`packed_pairs_gemm`, the greedy head's
    pair screen). Exact for a bf16 weight; others are rounded to bf16."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"pack_pairs: K must be even, got {k}")
    nb = -(-n // PACK_BLOCK)
    padded = torch.zeros(nb * PACK_BLOCK, k, dtype=torch.bfloat16)
    padded[:n] = w.detach().to(torch.bfloat16)
    pairs = padded.view(nb, PACK_BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()  # [NB, K/2, 32, 2]
    return pairs.view(torch.int32).view(nb, k // 2, PACK_BLOCK)


def unpack_pairs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_pairs` → the bf16 weight [n, K]."""
    nb, kp, _ = packed.shape
    pairs = packed.view(torch.bfloat16).view(nb, kp, PACK_BLOCK, 2)
    return pairs.permute(0, 2, 1, 3).reshape(nb * PACK_BLOCK, 2 * kp)[:n].contiguous()


def pair_path_available() -> bool:
    """Whether the kernels run bf16 x through AVX512-BF16's dot product here: `packed_pairs_gemm`,
    the pair path of `packed_w8_gemm` / `packed_w4_gemm` for bf16 x, and bf16 `paged_attention`."""
    mod = cpu_kernels()
    return mod is not None and mod.has_bf16_dot()


@contextlib.contextmanager
def pair_path(on: bool):
    """Inside the block the kernels take (on) or leave (off) the AVX512-BF16 pair path for bf16
    x, restored after (benches and tests compare the two); a no-op where the path does not exist."""
    if not pair_path_available():
        yield
        return
    with _switch("set_pair_path", on):
        yield


@contextlib.contextmanager
def _switch(setter: str, on: bool):
    """The extension's setting `setter` (a `set_*` that returns the previous value) at `on` inside
    the block, restored after; a no-op where the kernels are not built."""
    mod = cpu_kernels()
    if mod is None:
        yield
        return
    was = getattr(mod, setter)(on)
    try:
        yield
    finally:
        getattr(mod, setter)(was)


@contextlib.contextmanager
def prefill_blocks(on: bool):
    """Inside the block `paged_attention` takes (on, the default) or leaves (off) its blocked
    kernel for fresh prompts of 16+ tokens, fp32 and bf16 on the AVX512-BF16 pair path
    (`csrc/cpu.cpp`, `prefill_block` / `prefill_block_pairs`: queries on the vector lanes, each key
    read once for a block of rows), restored after; off, those prompts take the per-row kernel of
    decode steps (benches and tests compare the two). A no-op where the kernels are not built."""
    with _switch("set_prefill_blocks", on):
        yield


@contextlib.contextmanager
def prefetch(on: bool):
    """Inside the block the greedy head screen (`screened_argmax_pairs`, verification steps of 7+
    drafts) prefetches (on) or does not prefetch (off) the next block of its bf16 copy into L2
    while computing one (`csrc/cpu.cpp`, kPrefetchRows), restored after; the ids are the same
    either way (benches compare the speed). A no-op where the kernels are not built."""
    with _switch("set_prefetch", on):
        yield


def packed_pairs_gemm(x: torch.Tensor, w_pairs: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 contiguous (any M), w_pairs from `pack_pairs` of a [n, K] weight, bias [n]
    fp32 → [M, n] bf16 (fp32 accumulation; needs AVX512-BF16: `pair_path_available()`)."""
    return _need().packed_pairs_gemm(x, w_pairs, n, bias)


def packed_pairs_gemm_ref(x, w_pairs, n, bias=None):
    y = x.float() @ unpack_pairs(w_pairs, n).float().t()
    return (y if bias is None else y + bias).to(x.dtype)


def pack_w8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] → [NB, K, 32] column blocks (the layout of `pack_dense`)."""
    return _blocks(q.to(torch.int8))


def unpack_w8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_w8` → the int8 codes [n, K]."""
    return _unblock(packed, n)


def pack_w8_pairs(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K even) → [NB, K/2, 64], the int8 head screen's layout
    (`screened_argmax_i8`): in column block b at k-pair p, bytes 2j and 2j + 1 hold column
    32 b + j at k = 2p and 2p + 1 (N zero-padded), so one sign extension gives 16 outputs' int16
    pairs for AVX512-VNNI's vpdpwssd."""
    n, k = q.shape
    if k % 2:
        raise ValueError(f"pack_w8_pairs: K = {k} must be even")
    nb = -(-n // PACK_BLOCK)
    padded = torch.zeros(nb * PACK_BLOCK, k, dtype=torch.int8)
    padded[:n] = q.detach()
    return padded.reshape(nb, PACK_BLOCK, k // 2, 2).permute(0, 2, 1, 3).reshape(nb, k // 2, 2 * PACK_BLOCK).contiguous()


def unpack_w8_pairs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_w8_pairs` → the int8 codes [n, K]."""
    nb, kp, _ = packed.shape
    return packed.reshape(nb, kp, PACK_BLOCK, 2).permute(0, 2, 1, 3).reshape(nb * PACK_BLOCK, 2 * kp)[:n].contiguous()


def pack_w4(q: torch.Tensor, scale: torch.Tensor, neg_zs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 codes q [N, K] (int8 in [-8, 7]) and their group scale / neg_zs [N, G] (fp32,
    w = q * scale + neg_zs) → (bytes [NB, K, 16], scale [NB, G, 32], offset [NB, G, 32]): in
    column block b at step k, byte j holds column 32 b + j in its low nibble and column
    32 b + j + 16 in its high one, each as the unsigned q + 8, so w = (q + 8) * scale + offset
    with offset = neg_zs - 8 * scale."""
    u = (_blocks(q.to(torch.int8)).to(torch.int16) + 8).to(torch.uint8)  # [NB, K, 32]
    packed = (u[:, :, :16] | (u[:, :, 16:] << 4)).contiguous()
    s = _blocks(scale.float())
    return packed, s, _blocks(neg_zs.float()) - 8 * s


def unpack_w4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The codes [n, K] of `pack_w4`'s bytes."""
    u = torch.cat([packed & 0x0F, packed >> 4], dim=2)  # [NB, K, 32]
    return _unblock((u.to(torch.int16) - 8).to(torch.int8), n)


def packed_w8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any M), q from `pack_w8`, scale [n] fp32 per output → [M, n] in x.dtype."""
    return _need().packed_w8_gemm(x, q, scale, n, bias)


def packed_w8_gemm_ref(x, q, scale, n, bias=None):
    y = (x.float() @ _unblock(q, n).float().t()) * scale[None, :]
    return (y if bias is None else y + bias).to(x.dtype)


def packed_w4_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   group: int, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any M); q, scale, offset from `pack_w4`; groups of `group` k → [M, n]."""
    return _need().packed_w4_gemm(x, q, scale, offset, group, n, bias)


def packed_w4_gemm_ref(x, q, scale, offset, group, n, bias=None):
    u = unpack_w4(q, n).float() + 8
    w = u * _unblock(scale, n).repeat_interleave(group, 1) + _unblock(offset, n).repeat_interleave(group, 1)
    y = x.float() @ w.t()
    return (y if bias is None else y + bias).to(x.dtype)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    q_lens: list[int], seq_lens: list[int], block_size: int, scale: float) -> torch.Tensor:
    """q [T, H, hd] (sequence b's q_lens[b] rows in order; fp32/bf16, hd 64 or 128); k_new, v_new
    [T, KV, hd] are written to k_cache, v_cache [slots, KV, hd] at slot_mapping [T]; then row i
    of sequence b (position seq_lens[b] − q_lens[b] + i) attends over its keys 0..position,
    found through block_tables [B, nb] → out [T, H, hd] (query head h reads KV head h // (H/KV)).
    fp32 accumulation; bf16 on a CPU with AVX512-BF16 (`pair_path_available()`) multiplies through
    its bf16 dot product, the softmax weights rounded to bf16 before the value product, as a bf16
    model's eager attention rounds its probabilities."""
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


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [M, 2 I] contiguous fp32/bf16 → silu(gate) * up [M, I] in x.dtype."""
    return _need().silu_mul(x)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
