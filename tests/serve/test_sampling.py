"""Sampling through the whole HTTP path with speculation on: the tokens a server returns for
temperature / top-k / top-p requests follow the target model's exact distribution (chi-square),
the rejection-sampling guarantee end to end."""

from __future__ import annotations

import asyncio

import httpx2
import torch

from quantspec.infer.sampler import logits_to_probs
from quantspec.model_zoo.llama import DenseCausalAttention

TEMPERATURE, TOP_K, TOP_P = 1.5, 3, 0.9
NEW_TOKENS = 3  # the first from the prefill, then one step that verifies a draft
REQUESTS, CONCURRENCY = 1024, 32


def _exact_texts(model, tokenizer, prompt: list[int], sequence_law) -> dict[str, float]:
    """The probability of each output text: the target's next-token law (temperature, top-k,
    top-p) chained over NEW_TOKENS tokens, summed over the sequences that decode alike."""
    def probs(ids):
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        return logits_to_probs(model.compute_logits(h[-1:]), torch.tensor([TEMPERATURE]), torch.tensor([TOP_K]),
                               torch.tensor([TOP_P]))[0]

    texts: dict[str, float] = {}
    for out, p in sequence_law(probs, prompt, NEW_TOKENS).items():
        text = tokenizer.decode(list(out), skip_special_tokens=True)
        texts[text] = texts.get(text, 0.0) + p
    return texts


def _looping_prompt(model, tokenizer) -> list[int]:
    """A prompt that ends in the model's own greedy text: the tiny random model loops, so its
    likely next tokens occur in the prompt and the n-gram proposer drafts their continuations."""
    ids = tokenizer("The quick brown fox").input_ids
    with torch.inference_mode():
        for _ in range(40):
            h = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
            ids.append(int(model.compute_logits(h[-1:]).argmax()))
    return ids


def test_sampled_outputs_through_the_server_follow_the_target_distribution(start_server, tiny_llama_model, metric,
                                                                          sequence_law, pooled_chisquare):
    model = tiny_llama_model
    with start_server(load_aware=False, max_batch_size=CONCURRENCY, speculate_max_draft_token_num=2) as (url, state):
        prompt = _looping_prompt(model, state.tokenizer)
        exact = _exact_texts(model, state.tokenizer, prompt, sequence_law)

        async def main():
            sem = asyncio.Semaphore(CONCURRENCY)

            async def one(http, seed):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": TEMPERATURE,
                        "top_k": TOP_K, "top_p": TOP_P, "seed": seed}
                async with sem:
                    r = await http.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            async with httpx2.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(one(http, seed) for seed in range(REQUESTS)))

        texts = asyncio.run(main())
        drafted = metric(url, "quantspec_spec_draft_tokens_total")
        accepted = metric(url, "quantspec_spec_accepted_tokens_total")
    assert drafted > REQUESTS // 4 and 0 < accepted < drafted  # speculation really ran, and sometimes rejected
    counts: dict[str, int] = {}
    for t in texts:
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) <= set(exact)  # nothing outside the top-k / top-p support
    assert sum(REQUESTS * p >= 5 for p in exact.values()) >= 3  # a law with several likely outputs
    assert pooled_chisquare(counts, exact, REQUESTS) > 1e-3
