"""Request defaults from the model's generation_config.json (`--generation-config auto`, vLLM's
default): a request that leaves out temperature, top_k or max_tokens gets the model's; a field it
gives wins; `--generation-config vllm` (or a directory of another config) changes what is read."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from quantspec.infer.loader import read_sampling_defaults

PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def configured_model(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a generation config that samples with top_k 1 (greedy, in effect) and
    stops at 5 new tokens."""
    d = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text())
    cfg.update(temperature=0.7, top_k=1, max_new_tokens=5, do_sample=True)
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


def test_the_sampling_fields_of_a_generation_config_are_read(configured_model, tiny_llama_dir):
    assert read_sampling_defaults(configured_model) == {"temperature": 0.7, "top_k": 1, "max_new_tokens": 5}
    assert read_sampling_defaults(tiny_llama_dir / "nowhere") == {}


def _ask(client, top_k=None, **kw):
    extra = {"ignore_eos": True, **({} if top_k is None else {"top_k": top_k})}
    r = client.completions.create(model="tiny", prompt=PROMPT, seed=3, extra_body=extra, **kw)
    return r.choices[0].text, r.usage.completion_tokens


@pytest.mark.parametrize("source", ["auto", "vllm", "dir"])
def test_requests_get_the_model_s_defaults_where_they_leave_fields_out(serve, configured_model, tiny_llama_dir,
                                                                      reference, source):
    from quantspec.serve.server import ServeConfig

    gen = {"auto": "auto", "vllm": "vllm", "dir": str(tiny_llama_dir)}[source]  # tiny_llama_dir's: no sampling fields
    config = ServeConfig(model=str(configured_model), served_model_name="tiny", max_batch_size=4, max_length=256,
                         generation_config=gen)
    with serve(config) as (url, state):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        greedy12 = reference(PROMPT, 12, chat=False, ignore_eos=True)[0]
        if source == "auto":
            assert state.sampling_defaults == {"temperature": 0.7, "top_k": 1, "max_new_tokens": 5}
            text, n = _ask(client)
            assert n == 5 and text == reference(PROMPT, 5, chat=False, ignore_eos=True)[0]  # top_k 1: greedy
            assert _ask(client, max_tokens=12) == (greedy12, 12)
            assert _ask(client, max_tokens=12, top_k=0)[0] != greedy12  # the request's top_k wins
        else:
            assert state.sampling_defaults == {}
            text, n = _ask(client, max_tokens=12)
            assert n == 12 and text != greedy12 and (text, n) == _ask(client, max_tokens=12, temperature=1.0)


def test_a_generation_config_that_is_no_directory_is_refused():
    from quantspec.errors import QuantSpecError
    from quantspec.serve.server import ServeConfig

    with pytest.raises(QuantSpecError, match="--generation-config"):
        ServeConfig(generation_config="/nowhere/at/all")


def test_override_generation_config_wins_over_the_model_s(serve, configured_model, reference):
    from quantspec.errors import QuantSpecError
    from quantspec.serve.server import ServeConfig

    config = ServeConfig(model=str(configured_model), served_model_name="tiny", max_batch_size=4, max_length=256,
                         override_generation_config='{"max_tokens": 3, "top_k": 1, "temperature": 1.5}')
    with serve(config) as (url, state):
        assert state.sampling_defaults == {"temperature": 1.5, "top_k": 1, "max_new_tokens": 3}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert _ask(client) == (reference(PROMPT, 3, chat=False, ignore_eos=True)[0], 3)  # top_k 1 still greedy
    for bad in ('{"temperature": "hot"}', '{"seed": 1}', "[1]", "{oops"):
        with pytest.raises(QuantSpecError, match="--override-generation-config"):
            ServeConfig(override_generation_config=bad)
