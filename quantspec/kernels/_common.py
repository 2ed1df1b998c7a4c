"""Shared plumbing for the Triton kernels: input validation that raises `QuantSpecError`, the
"can Triton run here" test, and small `tl` helpers every kernel uses (round-half-even).

Nothing here knows about models or quant types; it only checks tensors and launches.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterable, Iterator

import torch
import triton
import triton.language as tl

from quantspec.errors import QuantSpecError

__all__ = [
    "FLOAT_DTYPES",
    "FP8_E4M3_MAX",
    "INT8_MAX",
    "INT8_MIN",
    "can_launch",
    "check_same_device",
    "check_tensor",
    "dot_in_fp32",
    "finish_split_k",
    "gpu_launch",
    "grouped_tile",
    "interpreter_enabled",
    "pdl_begin",
    "pdl_kwargs",
    "pdl_launch",
    "programmatic_launches",
    "round_half_even",
    "round_to_e4m3",
    "small_ints_to_float",
    "split_k_arrive",
    "split_k_buffers",
    "split_k_partials",
    "split_k_counters",
    "split_k_sum",
    "triton_usable",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT8_MIN, INT8_MAX = -128, 127
FP8_E4M3_MAX = 448.0

# Adding then subtracting 1.5 * 2**23 rounds an fp32 of magnitude < 2**22 to the nearest integer
# with ties to even (IEEE default rounding), i.e. exactly what torch.round does. Pure arithmetic,
# so it runs under TRITON_INTERPRET=1 and on every GPU without libdevice.
_RNE_MAGIC = tl.constexpr(12582912.0)


def interpreter_enabled() -> bool:
    """True when Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# what kernels branch on at compile time: the interpreter reinterprets int16 bits as bf16 wrongly
# (read once, as triton reads TRITON_INTERPRET once)
_INTERPRETED = tl.constexpr(interpreter_enabled())


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether a kernel's `tl.dot` should take fp32 operands: fp32 inputs keep full precision
    everywhere, and the interpreter has no bf16 dot."""
    return dtype == torch.float32 or (interpreter_enabled() and dtype == torch.bfloat16)


SM_TARGET = 528  # programs a small-M launch aims for: four per SM of an H100 / H200 (132 SMs)
MAX_SPLIT_K = 8


def scaled_gemm_launch(M: int, N: int, K: int, on_gpu: bool) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K) of an int8 / FP8 GEMM launch. On a GPU,
    tiles by M; where they are too few to fill the GPU (small M), split-K up to about `SM_TARGET`
    programs, bounded so that the partial sums (split · M · N words of 4 bytes, written once and
    read once) cost at most a quarter of the weight's bytes (split ≤ K / 32M). On the CPU
    interpreter tiny tiles."""
    if not on_gpu:
        bm, bn, bk, warps, stages = 16, 16, 32, 4, 1
        split = 1
    else:
        bm, bn, bk, warps, stages = (
            (128, 256, 128, 8, 3) if M >= 1024 else (64, 128, 128, 4, 4) if M > 64
            else (64, 64, 128, 4, 4) if M > 16 else (16, 64, 128, 4, 4)
        )
        tiles = max(1, triton.cdiv(M, bm) * triton.cdiv(N, bn))
        # up to 16 rows one launch shape (split included): a row's numbers do not depend on the
        # other rows, so a verification row gives what its decode step gives
        split = max(1, min(MAX_SPLIT_K, triton.cdiv(K, bk) // 2, triton.cdiv(SM_TARGET, tiles),
                           K // (32 * max(M, 16))))
    return bm, bn, bk, warps, stages, split


@triton.jit
def split_k_sum(p_ptr, mask, stride_split, SPLIT: tl.constexpr):
    """The split-K partial sums at `p_ptr` (split s at p_ptr + s · stride_split), added in split
    order in their dtype. Read past L1 (`.cg`): other programs of the launch wrote them. A loop,
    not unrolled: the loads of all splits at once would hold a GEMV's tile of each in registers,
    more than its main loop needs, and so fewer programs per SM."""
    acc = tl.load(p_ptr, mask=mask, other=0, cache_modifier=".cg")
    for s in tl.range(1, SPLIT):
        acc += tl.load(p_ptr + s * stride_split, mask=mask, other=0, cache_modifier=".cg")
    return acc


@triton.jit
def split_k_arrive(cnt_ptr, tile, splits):
    """Called by every program of a split-K launch once its partial sums of output tile `tile`
    are stored: → how many of the tile's `splits` arrived before it. The one that finds
    splits - 1 is the tile's last: it sums the partials (`split_k_sum`, in split order, so the
    numbers do not depend on which split finishes last) and applies the epilogue, and it sets the
    tile's counter back to zero, so that the counters are zero between launches (CUDA graph
    replays included)."""
    tl.debug_barrier()  # every thread's partial stores come before the (release) count
    before = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    # the next launch sees the reset (a kernel boundary orders them): no fence needed
    tl.atomic_xchg(cnt_ptr + tile, 0, mask=before == splits - 1, sem="relaxed")
    return before


@triton.jit
def split_k_partials(acc, p_ptr, mask, stride_split, pid_split, cnt_ptr, tile, SPLIT: tl.constexpr,
                     FINISH: tl.constexpr):
    """A GEMM program's epilogue start, for its sums `acc` of an output tile under `mask` →
    (acc, the mask its epilogue stores y under). SPLIT == 1: both as they are. Otherwise the
    partial sums are stored at p_ptr + pid_split · stride_split, and with FINISH the tile's last
    split to arrive takes every split's sum (`split_k_arrive`, `split_k_sum`) under `mask`, the
    others an empty mask; without FINISH there is no epilogue in this launch."""
    if SPLIT > 1:
        tl.store(p_ptr + pid_split * stride_split, acc, mask=mask)
        if FINISH:
            before = split_k_arrive(cnt_ptr, tile, SPLIT)
            mask = mask & ((mask.to(tl.int32) * 0 + before) == SPLIT - 1)
            acc = split_k_sum(p_ptr, mask, stride_split, SPLIT)
    return acc, mask


@triton.jit
def split_k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[lo, hi) of the k range of this program's split (grid axis 1): whole BLOCK_K tiles, the
    splits taking equal runs of them; with SPLIT_K == 1, [0, K)."""
    if SPLIT_K == 1:
        lo = 0
        hi = K
    else:
        tiles = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        lo = tl.program_id(1) * tiles * BLOCK_K
        hi = tl.minimum(K, lo + tiles * BLOCK_K)
    return lo, hi


@triton.jit
def _finish_scaled_split_k_kernel(p_ptr, as_ptr, bs_ptr, b_ptr, out_ptr, MN, N, SPLIT: tl.constexpr,
                                  PER_TOKEN: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = split_k_sum(p_ptr + offs, mask, MN, SPLIT)
    if PER_TOKEN:
        a_s = tl.load(as_ptr + offs // N, mask=mask, other=0.0)
    else:
        a_s = tl.load(as_ptr + offs * 0)
    if PER_CHANNEL:
        b_s = tl.load(bs_ptr + offs % N, mask=mask, other=0.0)
    else:
        b_s = tl.load(bs_ptr + offs * 0)
    y = acc.to(tl.float32) * a_s * b_s
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def finish_scaled_split_k(partials: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The int8 / FP8 GEMMs' split-K partial sums [split, M, N] (int32: exact, or fp32) → `out`
    [M, N], in a launch of its own (where `split_k_buffers` gave no counters): summed in split
    order, then the GEMMs' epilogue acc · x_scale · w_scale (+ bias) in fp32 (per-token x_scale
    of M values or one; per-channel w_scale of N or one), without FMA contraction, so that it
    rounds as the unsplit launch's epilogue does."""
    split, M, N = partials.shape
    if M * N:
        block = 1024
        _finish_scaled_split_k_kernel[(triton.cdiv(M * N, block),)](
            partials, x_scale, w_scale, bias if bias is not None else w_scale, out, M * N, N, SPLIT=split,
            PER_TOKEN=x_scale.numel() == M and M != 1, PER_CHANNEL=w_scale.numel() == N and N != 1,
            HAS_BIAS=bias is not None, BLOCK=block, enable_fp_fusion=False, **pdl_kwargs(partials.device))
    return out


# Arrival counters of split-K launches on a GPU, one set per device, made once: each launch
# leaves them zero, and quantspec runs a device's work on one stream at a time, so no two
# launches share them at once; a launch of more output tiles than this finishes in a launch of
# its own.
SPLIT_K_COUNTERS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_k_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed int32 arrival counters for a split-K launch of `tiles` output tiles
    (`split_k_arrive`), or None: the launch then stores its partial sums and a second launch
    sums them (`finish_split_k`, `finish_scaled_split_k`). None where the tiles are more than
    `SPLIT_K_COUNTERS`, or where the device's counters would first be made inside a CUDA graph
    capture (nothing runs during a capture, so they would not be zero when the graph is not yet
    replayed). On the CPU interpreter a fresh set per launch."""
    if device.type != "cuda":
        return torch.zeros(max(tiles, 1), dtype=torch.int32, device=device)
    counters = _COUNTERS.get(device)
    if counters is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(SPLIT_K_COUNTERS, dtype=torch.int32, device=device)
    return counters if tiles <= counters.numel() else None


def split_k_buffers(M: int, N: int, split: int, tiles: int, device: torch.device, out_dtype: torch.dtype,
                    part_dtype: torch.dtype = torch.float32, in_kernel: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(part, out, counters) of a GEMM launch of `tiles` output tiles: out [M, N] in `out_dtype`;
    where split == 1 the launch writes it directly (part is out, no counters); otherwise part
    holds the [split, M, N] partial sums in `part_dtype` (deterministic, no atomic adds of
    numbers), which the tiles' last splits sum into out (`counters`), or where counters is None
    (or `in_kernel` is False) `finish_split_k` / `finish_scaled_split_k` after the launch."""
    out = torch.empty((M, N), device=device, dtype=out_dtype)
    if split == 1:
        return out, out, None
    part = torch.empty((split, M, N), device=device, dtype=part_dtype)
    return part, out, split_k_counters(device, tiles) if in_kernel else None


@triton.jit
def _finish_split_k_kernel(p_ptr, b_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_begin(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = split_k_sum(p_ptr + offs, mask, MN, SPLIT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def finish_split_k(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The weight-only kernels' fp32 split-K partial sums [split, M, N] → `out` [M, N], in a
    launch of its own (where `split_k_buffers` gave no counters): summed in split order, then
    the bias added and the sum cast, as the tiles' last splits do in the GEMM's launch."""
    split, M, N = part.shape
    if M * N:
        block = 1024
        _finish_split_k_kernel[(triton.cdiv(M * N, block),)](
            part, bias if bias is not None else part, out, M * N, N, SPLIT=split, HAS_BIAS=bias is not None,
            BLOCK=block, **pdl_kwargs(part.device))
    return out


def gpu_launch(device: torch.device) -> bool:
    """Whether a launch on `device` takes a GPU's launch configs (tile sizes, native operand
    types). Every kernel's host function asks here, so that one switch makes a CPU call record
    the launch a GPU would get (`tests/kernels/test_gpu_compile.py`)."""
    return device.type == "cuda"


_PDL = contextvars.ContextVar("quantspec_programmatic_launches", default=False)


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True) -> Iterator[None]:
    """Within (in this thread): every quantspec Triton launch on a GPU of compute capability 9.0
    or more is a programmatic dependent launch (`pdl_launch`), in CUDA graphs captured there too.
    The GPU may then start a kernel's programs while the kernel before it finishes, instead of
    after: each such kernel first waits for its predecessor's writes (`pdl_begin`), so the
    numbers are the same, and the gap between two kernels (their launch and ramp) shrinks."""
    token = _PDL.set(bool(enabled))
    try:
        yield
    finally:
        _PDL.reset(token)


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def pdl_launch(device: torch.device) -> bool:
    """Whether a launch on `device` is a programmatic dependent launch: inside
    `programmatic_launches`, on a GPU of compute capability 9.0 or more (Hopper's grid dependency
    control)."""
    return _PDL.get() and gpu_launch(device) and _capability(device) >= (9, 0)


def pdl_kwargs(device: torch.device) -> dict:
    """The arguments a launch on `device` adds for `pdl_begin`: its USE_PDL constexpr
    (`pdl_launch`), and where that is true the launch option that makes it one."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_launch(device) else {"USE_PDL": False}


@triton.jit
def pdl_begin(USE_PDL: tl.constexpr):
    """A kernel's first statement. USE_PDL (a programmatic dependent launch): wait until the
    kernel before it in the stream has completed and its writes are visible, before this kernel
    reads or writes anything, then let the next kernel's launch begin (its programs wait in
    their own `pdl_begin`). Without USE_PDL nothing."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def triton_usable(device: torch.device | str) -> bool:
    """Whether dispatch should pick the Triton kernels for tensors on `device`: CUDA only.

    On CPU this is False even under `TRITON_INTERPRET=1` (the interpreter is for testing the
    kernels, far slower than the torch references), so a test run that sets the variable does
    not slow down the runtime's CPU paths.
    """
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available()


def can_launch(device: torch.device | str) -> bool:
    """Whether a Triton kernel can be launched at all on `device` (CUDA, or CPU under the
    interpreter)."""
    device = torch.device(device)
    return triton_usable(device) or (device.type == "cpu" and interpreter_enabled())


def check_tensor(
    t: object,
    name: str,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Validate one kernel argument; raise a one-line `QuantSpecError` naming it and the fix."""
    if not isinstance(t, torch.Tensor):
        raise QuantSpecError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise QuantSpecError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}; reshape it first")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise QuantSpecError(
                f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of: {allowed}"
            )
    if shape is not None:
        ok = len(shape) == t.ndim and all(s is None or s == d for s, d in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise QuantSpecError(f"{name} has shape {list(t.shape)}; expected {want}")
    if contiguous and not t.is_contiguous():
        raise QuantSpecError(f"{name} must be contiguous; call .contiguous() on it first")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device, and Triton able to run there; return that device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            raise QuantSpecError(f"{name} is on {dev} but the other inputs are on {first}; move it")
    if not can_launch(first):
        raise QuantSpecError(
            f"Triton kernels cannot run on {first}; use the *_ref torch function there "
            "(or set TRITON_INTERPRET=1 to run the interpreter on CPU)"
        )
    return first


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped launch order: GROUP_M row tiles share each
    weight column tile while it is in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit
def small_ints_to_float(v, OFFSET: tl.constexpr, DTYPE: tl.constexpr, BELOW_128: tl.constexpr):
    """v - OFFSET as exact DTYPE values, for int32 v in [0, 1024) (with BELOW_128: [0, 128)): a
    weight code made non-negative. No int-to-float conversion instruction (a quarter of the FMA
    rate on recent GPUs, the limit of a dequantizing GEMV): for fp16, v goes into the mantissa of
    1024.0 (bits 0x6400 + v) and 1024 + OFFSET is subtracted in fp16; for bf16 with BELOW_128 (a
    compiled kernel), into the mantissa of 128.0 (bits 0x4300 + v) and 128 + OFFSET is subtracted
    in bf16; otherwise into the mantissa of 2**23, 2**23 + OFFSET subtracted in fp32 (then, for
    bf16, an exact cast of a small integer). Every step is exact; the 16-bit subtractions take
    two values per instruction on a GPU."""
    if DTYPE == tl.float16:
        out = (v + 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + OFFSET)
    elif DTYPE == tl.bfloat16 and BELOW_128 and not _INTERPRETED:
        out = (v + 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (128.0 + OFFSET)
    else:
        out = ((v + 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)).to(DTYPE)
    return out


@triton.jit
def round_half_even(x):
    """Round an fp32 tensor with |x| < 2**22 to integers, ties to even (matches torch.round)."""
    return (x + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def round_to_e4m3(v):
    """Round fp32 values already clamped to ±448 onto the float8_e4m3fn grid (nearest, ties even).

    The result is exactly representable, so the following `.to(tl.float8e4nv)` is exact. This
    keeps the rounding independent of the backend's conversion (Triton's CPU interpreter rounds
    values just below a power of two down instead of up).
    """
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # unbiased exponent; subnormals share 2**-6
    inv_step = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3): spacing of 3-bit mantissa
    r = round_half_even(v * inv_step) * step
    # keep the sign of values that round to zero (torch gives -0.0 for small negatives)
    sign = (bits >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
