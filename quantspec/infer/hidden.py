"""Generation that also returns the model's hidden states: the data of draft-head training.

`generate_with_hidden` answers chat prompts greedily with the engine and captures, through a
forward hook on the model, the pre-norm hidden state at every position it fed (nothing is run
twice): what self-distillation trains an MTP module (or another draft head) on.
`generate_answers` gives the answers alone, from the engine on the backend's packed bf16 stack
(about three times the tokens/s of the float modules): for recipes that recompute the base's features
on the answers anyway (EAGLE-3).
"""

from __future__ import annotations

__all__ = ["chat_encode", "generate_answers", "generate_with_hidden"]


def chat_encode(tokenizer, prompts) -> list[list[int]]:
    """Each prompt as one user turn under the model's chat template, ready for the answer."""
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def generate_answers(model, prompts, *, max_new_tokens: int, batch_size: int, on_status=None):
    """Greedy chat answers of `model` (a zoo name or directory) for `prompts`, by the engine on the
    CPU backend in bf16. → list of token tensors [L] int64: the chat-templated prompt, then the
    answer. The answers are the bf16 model's: where its argmax and the float model's tie closely
    they may part, which a recipe that scores every position by the float base's own forward
    does not mind."""
    import torch

    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.sampler import SamplingParams

    loaded = load_for_inference(model, dtype=torch.bfloat16)
    encoded = chat_encode(loaded.tokenizer, prompts)
    eng = Engine(loaded.model, EngineConfig(max_batch_size=batch_size, max_length=max(map(len, encoded)) +
                                            max_new_tokens + 1),
                 eos_token_ids=loaded.eos_token_ids, runtime=loaded.runtime)
    seqs = [eng.add_request(ids, SamplingParams(max_new_tokens=max_new_tokens)) for ids in encoded]
    eng.run(_progress(seqs, on_status))
    return [torch.tensor(s.tokens, dtype=torch.int64) for s in seqs]


def _progress(seqs, on_status):
    """An engine step callback that reports every 16 finished answers to `on_status`."""
    done = [0]

    def on_step(_events):
        finished = sum(s.finished for s in seqs)
        if on_status is not None and finished // 16 > done[0] // 16:
            on_status(f"self-distillation: {finished}/{len(seqs)} answers generated")
        done[0] = finished

    return on_step


def generate_with_hidden(base, tokenizer, prompts, *, max_new_tokens: int, batch_size: int, on_status=None):
    """Greedy chat answers of the base for `prompts`, with the base's pre-norm hidden state at
    every fed position (captured by a forward hook on the engine's model, so nothing is run
    twice). → list of (tokens [L] int64, hidden [L-1, D] bf16)."""
    import torch

    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams

    encoded = chat_encode(tokenizer, prompts)
    max_len = max(len(e) for e in encoded) + max_new_tokens + 1
    eng = Engine(base, EngineConfig(max_batch_size=batch_size, max_length=max_len, all_hidden_rows=True),
                 eos_token_ids=base.args.eos_token_ids)
    seqs = [eng.add_request(ids, SamplingParams(max_new_tokens=max_new_tokens)) for ids in encoded]
    chunks: dict[int, list] = {s.seq_id: [] for s in seqs}

    def hook(_module, _inputs, hidden):  # hidden [T, D]: the rows of this step's sequences, in order
        off = 0
        for s, n in eng.forward_rows:  # not `running`: a prefill step feeds only the new prompts
            chunks[s.seq_id].append(hidden[off:off + n].to(torch.bfloat16).cpu())
            off += n
        assert off == hidden.shape[0], (off, hidden.shape)

    handle = base.register_forward_hook(hook)
    try:
        eng.run(_progress(seqs, on_status))
    finally:
        handle.remove()
    out = []
    for s in seqs:
        tokens = torch.tensor(s.tokens, dtype=torch.int64)
        hidden = torch.cat(chunks[s.seq_id])  # the last token is never fed
        assert hidden.shape[0] == len(tokens) - 1, (hidden.shape, len(tokens))
        out.append((tokens, hidden))
    return out
