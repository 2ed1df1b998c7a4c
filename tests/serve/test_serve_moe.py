"""A quantized mixture of experts served: `serve` over a Qwen3-MoE int4 artifact, with n-gram
speculation and two requests in one batch, answers what `quantspec infer` does alone."""

from __future__ import annotations

import concurrent.futures

import openai

from quantspec import api
from quantspec.infer.predictor import InferConfig, Predictor
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.serve.server import ServeConfig

PROMPTS = ("Tell me a story about the sea", "The quick brown fox jumps over the lazy dog. The quick brown fox")


def test_a_moe_artifact_serves_as_infer_runs_it(serve, tmp_path):
    model = build_tiny_model(tmp_path / "moe", "qwen3_moe", num_layers=2)
    art = api.quantize(str(model), "weight_only_int4", tmp_path / "moe.w4", group_size=32)
    want = [Predictor(InferConfig(model=str(art), max_new_tokens=20, max_length=256, chat_template=True)
                      ).generate([p])[0].text for p in PROMPTS]
    config = ServeConfig(model=str(art), served_model_name="moe", max_length=256, max_batch_size=4,
                         speculate_method="inference_with_reference")
    with serve(config) as (url, state):  # loaded as the server loads it
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

        def ask(prompt):
            return client.chat.completions.create(model="moe", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=20, temperature=0).choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, PROMPTS))
    assert got == want and all(want)
