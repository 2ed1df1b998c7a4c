"""The OpenAI request bodies the server reads, as typed pydantic models, and OpenAI-style errors.

Fields that do not change the answer (`user`, `metadata`, ...) are accepted and ignored; a field
the server reads with the wrong type is a 400 naming the field, and so is a field of OpenAI's or
vLLM's it does not implement set to anything but its neutral value (`UNSUPPORTED`), never a
silently different answer. vLLM's `allowed_token_ids`, `bad_words`, `prompt_logprobs`,
`return_token_ids`, `return_tokens_as_token_ids`, `truncate_prompt_tokens`, `skip_special_tokens`, `include_stop_str_in_output`, and for chat
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and `echo`, apply as vLLM defines them, and so does
`priority` on a server started with `--scheduling-policy priority`; `response_format` and `structured_outputs` hold the answer to a form (`infer.structured`). `speculate` is quantspec's own field: `false` turns speculation off for the request (the
openai client sends it with `extra_body={"speculate": False}`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from quantspec.infer.sampler import MAX_LOGPROBS

__all__ = ["UNSUPPORTED", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "GenerationRequest",
           "TokenizeRequest", "error_body"]

Real = StrictInt | StrictFloat
MAX_CHOICES = 128  # the most answers per prompt a request may ask for (`n`, OpenAI's bound)
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]

# fields of OpenAI's or vLLM's requests the server does not implement, with their neutral values (any
# other value is a 400) and what to send instead, if anything
UNSUPPORTED = (
    ("best_of", 1, ""), ("use_beam_search", False, ""), ("length_penalty", 1.0, ""),
    ("spaces_between_special_tokens", True, ""), ("logits_processors", None, ""),
    ("guided_json", None, "structured_outputs.json"), ("guided_regex", None, "structured_outputs.regex"),
    ("guided_choice", None, "structured_outputs.choice"), ("guided_grammar", None, "structured_outputs.grammar"),
    ("functions", None, "tools"), ("function_call", None, "tool_choice"),
)


class StreamOptions(BaseModel):
    """OpenAI's `include_usage` (a last chunk with the request's usage) and vLLM's
    `continuous_usage_stats` (with it: the usage so far in every chunk)."""

    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: StrictStr | None = None
    json_schema: dict = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON that fits `json_schema.schema`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema (`json`, an object or its text),
    a regular expression, a list of choices, an EBNF grammar, or any JSON (`json_object`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    json_spec: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class GenerationRequest(BaseModel):
    """What both endpoints share: the sampling knobs, `n` answers per prompt (each its own choice,
    drawn from its own random stream), streaming, the speculation opt-out, vLLM's `ignore_eos`,
    `stop_token_ids` and `min_tokens`, and structured outputs (OpenAI's `response_format`, vLLM's
    `structured_outputs`). Penalties, a logit bias (keyed by token id), `min_tokens` and vLLM's
    `bad_words` follow `SamplingParams`' definitions; drafts are verified under them and under a
    structured output's grammar, each row after the drafts on its path (`infer.adjust`). vLLM's
    `prompt_logprobs` n: each prompt token's log-probability, rank and its position's n most likely
    tokens, in vLLM's shape (not with `stream`)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Real, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Real, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[Real, Field(ge=0, le=1)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    speculate: StrictBool = True
    presence_penalty: Annotated[Real, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Real, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Real, Field(gt=0)] | None = None
    logit_bias: dict[StrictStr, Annotated[Real, Field(ge=-100, le=100)]] | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    allowed_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)] | None = None
    bad_words: list[StrictStr] | None = None  # vLLM's: words the answer may not hold
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: each prompt token's log-probability and n most likely
    return_token_ids: StrictBool = False  # vLLM's: the prompt's and each answer's token ids beside the text
    return_tokens_as_token_ids: StrictBool = False  # vLLM's: logprobs name tokens "token_id:{id}"
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # keep the prompt's last n tokens
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: StrictInt = 0  # vLLM's: lower first, under --scheduling-policy priority

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    """`logprobs`: each output token's log-probability in `choices[].logprobs.content`, with the
    `top_logprobs` most likely tokens of its position. `tools` / `tool_choice`: OpenAI's; a call
    is made where `tool_choice` forces one, or found in the answer under "auto" by the server's
    tool-call parser (`serve/tools.py`). `echo` (vLLM's): an answer in the role of the last message
    starts with that message's text."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True  # OpenAI's: false, at most one call
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the last (assistant) message is continued, not closed
    chat_template_kwargs: dict | None = None  # extra variables of the chat template
    echo: StrictBool = False
    # OpenAI's, to templates that read it (as a chat_template_kwargs variable, as vLLM hands it on)
    reasoning_effort: StrictStr | None = None
    include_reasoning: StrictBool = True  # vLLM's: false leaves a reasoning parser's thinking out of the answer

    def template_kwargs(self) -> dict | None:
        """`chat_template_kwargs` with `reasoning_effort` where the request gives one."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class CompletionRequest(GenerationRequest):
    """`prompt`: a string, token ids, or a list of either (one choice per prompt, `index` its
    place). `logprobs` n: each token's log-probability and its position's n most likely tokens
    (the legacy `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` object); `echo`: the
    prompt comes back before the answer (with `logprobs`, the prompt's tokens too, the first one's
    None); `max_tokens` 0 with `echo` scores the prompt and generates nothing."""

    prompt: (StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    logprobs: TopLogprobs | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice: strings or token-id lists."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TokenizeRequest(BaseModel):
    """`/tokenize` (vLLM's): a `prompt` as `/v1/completions` tokenizes it (`add_special_tokens`), or
    chat `messages` as `/v1/chat/completions` does (the template; `add_generation_prompt`)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
