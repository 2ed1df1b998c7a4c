"""The layer-by-layer runner: a calibration batch through a decoder one layer at a time.

This file owns the loop that GPTQ (`calib/ptq.py`) and activation / KV-cache calibration share:

1. embed the calibration batch `input_ids [n, S]` once → `x [n, S, D]`;
2. for each decoder layer i, hand the caller a `LayerStep` (the layer, its name, its inputs) so it
   can attach hooks — forward pre-hooks on the Linears that feed `HessianAccumulator`s or
   observers, and the attention's `kv_hook(layer, k [B, S, KV, hd], v)` through a
   `DenseCausalAttention`;
3. run the layer over all samples in mini-batches of `batch_size` samples (bounds the attention's
   memory) → `y [n, S, D]`;
4. let the caller modify the layer (e.g. quantize it) and, in *sequential* mode, re-run the
   modified layer so that the next layer's inputs are the outputs of the quantized one (GPTQ's
   sequential mode: errors of earlier layers are seen, and compensated, by later ones);
5. drop the inputs: `y` becomes the next layer's `x`. Only one layer's inputs and outputs are held.

A step also runs its layer on other inputs of the batch's shape (`LayerStep.run`: the float
model's hidden states AutoRound keeps beside the quantized model's) and on a few samples under
autograd, the layer called as the caller likes (`LayerStep.call`: AutoRound's tuning steps).

Every mini-batch output is checked for NaN/Inf; a non-finite value raises `QuantSpecError` naming
the layer (e.g. fp16 overflow, or a broken quantization).

Streaming (`weights=`, a `model_zoo.checkpoint.CheckpointReader` or a checkpoint directory):
for models larger than memory the `Transformer` is built on the `meta` device; the runner then
gathers the batch's embedding rows from the checkpoint (in blocks, never the whole table) and
reads each layer's tensors (in `dtype` on `device`) just before the layer runs,
and — unless `keep_layers=True` — returns them to `meta` once the step is done. No accelerate
hooks: resident are one layer's weights and one layer's inputs and outputs. The caller must take
whatever it wants from the layer (e.g. its quantized tensors) before the next step. The heap's
free pages go back to the system when a streamed pass grows past its steady state, and after its
last layer (`_HeapWatch`), so its memory does not grow with depth.

`start=i, inputs=x` begins at layer i with its inputs x [n, S, D] (a resumed run), skipping the
embedding and the layers before.

Use the iterator (`for step in LayerRunner(...)`) or the callback wrapper `run_layers`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from quantspec.errors import QuantSpecError, positive_int
from quantspec.model_zoo.checkpoint import CheckpointReader, release_free_heap
from quantspec.model_zoo.llama import DenseCausalAttention, Transformer
from quantspec.quant.primitives import all_finite

__all__ = ["DEFAULT_BATCH_SIZE", "LayerRunner", "LayerStep", "run_layers", "layer_prefix"]

# samples per forward: 8 × 512 tokens keeps SmolLM2's attention scores (8 × 9 × 512²) ≈ 75 MB
DEFAULT_BATCH_SIZE = 8
# a streamed pass hands the heap's free pages back when resident memory has grown this much over
# its steady state (`_HeapWatch`)
HEAP_SLACK_BYTES = 64 * 2**20

KVHook = Callable[[int, torch.Tensor, torch.Tensor], None]
Progress = Callable[[int, int, str], None]  # (layer index, num layers, phase) — phase "start"/"done"


def layer_prefix(i: int) -> str:
    """The HF module name of decoder layer i (`model.layers.{i}`)."""
    return f"model.layers.{i}"


@dataclass
class LayerStep:
    """One decoder layer's turn in the runner.

    `inputs` [n, S, D] are the layer's inputs (read-only); `outputs` [n, S, D] are filled by
    `forward()` and recomputed by `propagate()`; after the step they become the next inputs.
    """

    index: int
    name: str
    layer: nn.Module
    inputs: torch.Tensor
    _runner: "LayerRunner" = field(repr=False)
    outputs: torch.Tensor | None = None

    def forward(self, kv_hook: KVHook | None = None) -> torch.Tensor:
        """Run the layer over all samples (the hooks attached to it fire) → outputs [n, S, D]."""
        self.outputs = self._runner._run_layer(self, kv_hook)
        return self.outputs

    def propagate(self) -> torch.Tensor:
        """Re-run the (modified) layer so the next layer sees its outputs (sequential mode)."""
        return self.forward(None)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The layer over other inputs x [n, S, D] of this batch's shape (no hook, no gradient) →
        [n, S, D]; `inputs` and `outputs` stay as they are."""
        return self._runner._run_layer(self, None, x, torch.empty_like(x))

    def call(self, x: torch.Tensor, layer: Callable | None = None) -> torch.Tensor:
        """`layer` (default: the step's; any callable of the decoder layer's signature, e.g. a
        `torch.func.functional_call` of it) on samples x [b, S, D] of this batch → [b, S, D],
        under whatever autograd mode the caller is in."""
        return self._runner._call_layer(self, x, layer or self.layer, None)


class LayerRunner:
    """Iterate a calibration batch through the decoder layer by layer (module docstring).

    model: a `Transformer` (materialised, or on `meta` with `weights` set).
    input_ids: LongTensor [n, S]. batch_size: samples per forward. device: where activations
    and (streaming) the loaded layer live; defaults to the model's norm device (CPU for
    meta). After the loop, `hidden` holds the last layer's outputs [n, S, D] (pre final norm).
    """

    def __init__(self, model: Transformer, input_ids: torch.Tensor, *,
                 batch_size: int = DEFAULT_BATCH_SIZE, weights: CheckpointReader | str | Path | None = None,
                 keep_layers: bool = False, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, progress: Progress | None = None,
                 start: int = 0, inputs: torch.Tensor | None = None):
        if not isinstance(model, Transformer):
            raise QuantSpecError(f"LayerRunner needs a quantspec Transformer, got {type(model).__name__}")
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.dtype != torch.long:
            raise QuantSpecError("input_ids must be a LongTensor [num_samples, seq_len] "
                                 "(see calib.data.build_calibration_batches)")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise QuantSpecError(f"input_ids has shape {tuple(input_ids.shape)}; need at least one "
                                 "sample of at least one token")
        positive_int("batch_size", batch_size)
        vocab = model.args.vocab_size
        if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
            raise QuantSpecError(f"input_ids hold token ids outside [0, {vocab}); the tokenizer "
                                 "does not match the model")
        self.model, self.input_ids, self.batch_size = model, input_ids, batch_size
        self.keep_layers, self.progress = keep_layers, progress
        on_meta = model.model.norm.weight.device.type == "meta"
        if on_meta and weights is None:
            raise QuantSpecError("the model is on the meta device; pass weights= (the checkpoint "
                                 "or its CheckpointReader) so layers are loaded one at a time")
        self.weights = weights if weights is None or isinstance(weights, CheckpointReader) \
            else CheckpointReader(weights)
        self.device = torch.device(device) if device is not None else (
            torch.device("cpu") if on_meta else model.model.norm.weight.device)
        self.dtype = dtype or model.model.norm.weight.dtype
        self.hidden: torch.Tensor | None = None
        n, S = input_ids.shape
        if not 0 <= start <= self.num_layers or (start > 0) != (inputs is not None):
            raise QuantSpecError(f"start={start} needs the inputs of that layer (and inputs= a start > 0)")
        if inputs is not None and tuple(inputs.shape) != (n, S, model.args.hidden_size):
            raise QuantSpecError(f"inputs {tuple(inputs.shape)} do not fit a batch {n} × {S} of this model")
        self.start, self._inputs = start, inputs
        self._tables = _rope_tables(model, S, self.device)  # {local: (cos, sin) [S, hd]}

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    # ---- the loop ----------------------------------------------------------------------------
    @torch.no_grad()
    def _embed(self) -> torch.Tensor:
        if self._inputs is not None:
            return self._inputs.to(self.device, self.dtype)
        emb = self.model.model.embed_tokens
        if emb.weight.device.type == "meta":  # gather the batch's rows from the checkpoint
            x = self.weights.rows("model.embed_tokens.weight", self.input_ids, dtype=self.dtype,
                                  device=self.device)  # [n, S, D]
        else:
            x = emb(self.input_ids.to(self.device)).to(self.dtype)  # [n, S, D]
        return self.model.args.scale_embeddings(x)

    @torch.no_grad()
    def _run_layer(self, step: LayerStep, kv_hook: KVHook | None, x: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer over x [n, S, D] (default: the step's inputs) in mini-batches, into `out`
        (default: the step's outputs, allocated on first use)."""
        x = step.inputs if x is None else x
        if out is None:
            out = step.outputs if step.outputs is not None else torch.empty_like(x)  # [n, S, D]
        for b0 in range(0, x.shape[0], self.batch_size):
            yb = self._call_layer(step, x[b0:b0 + self.batch_size], step.layer, kv_hook)  # [b, S, D]
            if not all_finite(yb):
                raise QuantSpecError(f"{step.name} produced NaN/Inf on calibration samples "
                                     f"{b0}..{b0 + yb.shape[0] - 1}; use a wider dtype (--dtype float32) or "
                                     "check this layer's weights")
            out[b0:b0 + yb.shape[0]] = yb
        return out

    def _call_layer(self, step: LayerStep, xb: torch.Tensor, layer: Callable, kv_hook: KVHook | None) -> torch.Tensor:
        """`layer` on samples xb [b, S, D] at positions 0..S-1 → [b, S, D]."""
        b, S, D = xb.shape
        cos, sin = (t.repeat(b, 1) for t in self._tables[step.layer.self_attn.local_rope])  # [b*S, hd]
        attn = DenseCausalAttention.of(self.model.args, b, S, kv_hook)
        return layer(xb.reshape(b * S, D), cos, sin, attn).view(b, S, D)

    def __iter__(self) -> Iterator[LayerStep]:
        x = self._embed()
        if not all_finite(x):
            raise QuantSpecError("model.embed_tokens produced NaN/Inf; the checkpoint is corrupt")
        L = self.num_layers
        heap = _HeapWatch()
        for i in range(self.start, L):
            layer, name = self.model.model.layers[i], layer_prefix(i)
            if self.progress is not None:
                self.progress(i, L, "start")
            streamed = self.weights is not None and next(layer.parameters()).device.type == "meta"
            if streamed:
                self.weights.load(layer, name, dtype=self.dtype, device=self.device)
            step = LayerStep(index=i, name=name, layer=layer, inputs=x, _runner=self)
            try:
                yield step
                if step.outputs is None:  # the caller only looked: run it now
                    step.forward()
            finally:
                if streamed and not self.keep_layers:
                    CheckpointReader.release(layer)
            x = step.outputs
            step.inputs = step.outputs = None  # the previous activations can be freed
            if streamed:
                heap.check()
            if self.progress is not None:
                self.progress(i, L, "done")
        release_free_heap()  # the steps' temporaries, before what comes next (e.g. the head) allocates
        self.hidden = x


class _HeapWatch:
    """Hands the heap's free pages back (`release_free_heap`) when resident memory after a layer
    has grown by more than `slack` bytes over what it was after the first layer (or the first
    after the last trim). Temporaries freed between longer-lived tensors leave free pages that
    glibc keeps, a little more after every layer (≈ 20 MB a layer in the α search on
    Llama-3.2-1B's shapes), so a streamed pass would grow with depth; a trim also makes the next
    allocations fault their pages in again (≈ 30 ms a layer on the default model, whose steps
    keep a steady ≈ 50 MB of free pages), so a pass that does not grow is not trimmed."""

    def __init__(self, slack: int = HEAP_SLACK_BYTES):
        self.slack, self.base = slack, None

    def check(self) -> None:
        now = _resident_bytes()
        if self.base is None:
            self.base = now
        elif now > self.base + self.slack:
            release_free_heap()
            self.base = None  # the next layer's steady state


def _resident_bytes() -> int:
    """This process's resident memory (0 without /proc/self/statm: then nothing is trimmed)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def run_layers(model: Transformer, input_ids: torch.Tensor, *,
               before: Callable[[LayerStep], Callable[[], None] | None] | None = None,
               after: Callable[[LayerStep], None] | None = None,
               kv_hook: KVHook | None = None, sequential: bool = False,
               batch_size: int = DEFAULT_BATCH_SIZE, weights: CheckpointReader | str | Path | None = None,
               keep_layers: bool = False, device=None, dtype=None,
               progress: Progress | None = None) -> torch.Tensor:
    """Callback form of `LayerRunner`; returns the last layer's outputs [n, S, D].

    Per layer: `before(step)` (attach hooks; may return a cleanup function, called after the
    forward), `step.forward(kv_hook)`, cleanup, `after(step)` (e.g. quantize the layer), and in
    `sequential` mode `step.propagate()` so the next layer's inputs come from the modified layer.
    """
    runner = LayerRunner(model, input_ids, batch_size=batch_size, weights=weights,
                         keep_layers=keep_layers, device=device, dtype=dtype, progress=progress)
    with torch.no_grad():
        _drive(runner, before, after, kv_hook, sequential)
    return runner.hidden


def _drive(runner, before, after, kv_hook, sequential) -> None:
    for step in runner:
        cleanup = before(step) if before is not None else None
        try:
            step.forward(kv_hook)
        finally:
            if cleanup is not None:
                cleanup()
        if after is not None:
            after(step)
        if sequential:
            step.propagate()


# ---------------------------------------------------------------------------------------------
# helpers


def _rope_tables(model: Transformer, S: int, device: torch.device) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
    """{whether for Gemma 3's window layers (`Attention.local_rope`): cos/sin [S, hd] for positions
    0..S-1}: rows of the tables `Transformer.setup_rope` builds (built here on meta models), so
    streamed and whole-model forwards see the same numbers."""
    from quantspec.model_zoo.llama import rope_tables

    if model.cos is not None and model.cos.device.type != "meta" and model._rope_len >= S:
        tables = {False: (model.cos, model.sin), True: (model.local_cos, model.local_sin)}
    else:
        tables = rope_tables(model.args, max(S, model.args.max_position_embeddings))
    return {k: (cos[:S].to(device), sin[:S].to(device)) for k, (cos, sin) in tables.items() if cos is not None}
