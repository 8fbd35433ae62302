"""Request bodies of the OpenAI API (pydantic) and the error every failure turns into.

Request models are strict (no "5" for 5, no true for 1) and forbid unknown fields, as the
OpenAI API does ("Unrecognized request argument"): a typo such as ``max_token`` is an error,
not a silently ignored option. OpenAI fields that do not change the output (``user``,
``metadata``, ``store``, ``service_tier``, ...) are accepted and ignored; fields this server
cannot honour (``suffix``, ``best_of != n``, the Responses API's ``tools``, ``store: true``,
``previous_response_id``, ...) are accepted only at their neutral value, else a 400 saying why.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvserve.blend.prompt import SegmentedPrompt
from kvserve.cache_control import MAX_SALT_CHARS
from kvserve.config import BlendOptionError
from kvserve.request import DEFAULT_BLEND_FRACTION, check_blend_fraction
from kvserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutputs

MAX_CHOICES = 16          # n: each choice is one engine request
MAX_STOP_STRINGS = 4      # as the OpenAI API
MAX_BATCH_REQUESTS = 256  # prompts x n in one completions call
MAX_SEGMENTS = 64         # segments (documents) in one prompt


class APIError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CachePin(_Body):
    """kvserve's extension, in the spirit of Anthropic's ``cache_control`` breakpoints: pin the
    prompt's prefix up to here for ``ttl`` seconds (default 300) (docs/server.md, "Cache control")."""

    type: Literal["pin"]
    ttl: float | None = Field(None, gt=0)


class CompletionCachePin(CachePin):
    num_tokens: int | None = Field(None, ge=1)      # the breakpoint; default: the whole prompt


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's extension; accepted, usage comes at the end only


class JSONSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` (its current name for the ``guided_*`` fields)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GenerationFields(_Body):
    """What every generation endpoint shares (completions, chat, responses)."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)          # vLLM's extension; 0 disables it
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1 - MAX_CHOICES)   # choice j uses seed + j
    stream: bool = False
    ignore_eos: bool = False                        # vLLM's extension, for benchmarks
    cache_priority: Literal["normal", "high"] | None = None   # kvserve's: the retention class of its blocks
    # vLLM's: blocks are shared only between requests with the same salt (docs/server.md "Tenants")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)      # vLLM's extension
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)                             # vLLM's extension
    speculate: bool = True       # kvserve's: false keeps this request out of speculative decoding (docs/speculative.md)
    structured_outputs: StructuredOutputsBody | None = None      # vLLM's extension
    # kvserve's: texts in the prompt (documents) whose KV is reused from a standalone
    # computation, wherever they appear, recomputing blend_fraction of them (lossy; docs/blend.md)
    segments: list[str] | None = Field(None, max_length=MAX_SEGMENTS)
    blend_fraction: float | None = None
    # and how this prompt's recomputed tokens are picked (None: the engine's options)
    blend_selection: str | None = None
    blend_sink_tokens: int | None = None
    blend_last_segments: int | None = None
    # OpenAI fields that do not change the output: accepted, ignored
    user: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def segmented(self, text: str, param: str) -> SegmentedPrompt | None:
        """``text`` cut at the request's segments (None without any); APIError(400) when one does
        not occur in it (in order) or blending cannot apply."""
        if self.segments is None:
            for name in ("blend_fraction", "blend_selection", "blend_sink_tokens", "blend_last_segments"):
                if getattr(self, name) is not None:
                    raise bad_request(f"{name} applies to segments; none were given", name)
            return None
        if not self.segments:
            raise bad_request("segments must hold at least one text", "segments")
        try:
            fraction = DEFAULT_BLEND_FRACTION if self.blend_fraction is None else check_blend_fraction(self.blend_fraction)
        except ValueError as e:
            raise bad_request(str(e), "blend_fraction") from None
        try:
            return SegmentedPrompt.from_text(text, self.segments, fraction, self.blend_selection,
                                             self.blend_sink_tokens, self.blend_last_segments)
        except BlendOptionError as e:
            raise bad_request(str(e), e.option) from None
        except ValueError as e:
            raise bad_request(f"segments: {e} ({param})", "segments") from None

    def stop_strings(self) -> tuple[str, ...]:
        return ()

    def check_unsupported(self) -> None:
        """APIError(400) for what the endpoint accepts only at a neutral value."""

    def logit_bias_ids(self) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise bad_request(f"logit_bias keys must be token ids (strings of digits), got {key!r:.40}",
                                  "logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for {key}", "logit_bias")
            bias[int(key)] = value
        return bias

    def output_format(self) -> tuple[StructuredOutputs, str] | None:
        """The constraint the endpoint's own format field asks for, and that field."""
        return None

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """The output constraint asked for, and the field that asked; 400 when more than one does."""
        asked: list[tuple[StructuredOutputs, str]] = []
        own = self.output_format()
        if own is not None:
            asked.append(own)
        so = self.structured_outputs
        if so is not None:
            asked.append((_constraint("structured_outputs", json=so.json_, regex=so.regex, choice=so.choice,
                                      grammar=so.grammar, json_object=bool(so.json_object)), "structured_outputs"))
        if len(asked) > 1:
            raise bad_request(f"give one output constraint, not {' and '.join(p for _, p in asked)}", asked[1][1])
        return asked[0] if asked else (None, None)

    def sampling_params(self, choice: int, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutputs | None = None) -> SamplingParams:
        """The parameters of choice ``choice`` (its seed is ``seed + choice``), with the
        endpoint's own token limit, logprobs and output constraint; APIError(400) for values
        they refuse."""
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.effective_temperature, top_p=self.effective_top_p,
                top_k=self.top_k or 0, seed=None if self.seed is None else self.seed + choice,
                stop=self.stop_strings(), ignore_eos=self.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias=tuple(self.logit_bias_ids().items()), min_tokens=self.min_tokens, structured=structured,
                speculate=self.speculate)
        except ValueError as e:
            raise bad_request(str(e)) from None

    @property
    def effective_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature

    @property
    def effective_top_p(self) -> float:
        return 1.0 if self.top_p is None else self.top_p


def _constraint(param: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None


def _json_format(kind: str, schema: dict[str, Any] | None, param: str,
                 schema_field: str) -> tuple[StructuredOutputs, str] | None:
    """The constraint of a ``json_object`` or ``json_schema`` format (None for ``text``)."""
    if kind == "json_object":
        return StructuredOutputs(json_object=True), param
    if kind != "json_schema":
        return None
    if schema is None:
        raise bad_request(f"{param} json_schema needs {schema_field}", param)
    return _constraint(param, json=schema), param


class _SamplingFields(GenerationFields):
    """What completions and chat add."""

    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
        if any(not s for s in stop):
            raise bad_request("stop: stop strings must be non-empty", "stop")
        return tuple(stop)

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def output_format(self) -> tuple[StructuredOutputs, str] | None:
        rf = self.response_format
        if rf is None:
            return None
        return _json_format(rf.type, None if rf.json_schema is None else rf.json_schema.schema_, "response_format",
                            "json_schema.schema")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    cache_control: CompletionCachePin | None = None   # kvserve's: pin the prompt (or its first num_tokens)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported by this server (it may only equal n)", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)", "max_tokens")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt is empty", "prompt")
        if isinstance(p[0], int):
            return [p]
        return p


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant's earlier calls
    refusal: str | None = None
    cache_control: CachePin | None = None            # kvserve's: pin the conversation up to this message

    @property
    def text(self) -> str:
        return _joined(self.content)


def _joined(content: str | list[TextPart] | list[ResponseTextPart] | None) -> str:
    """A message's text: the string, or its text parts joined."""
    return "".join(part.text for part in content) if isinstance(content, list) else content or ""


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise bad_request("messages must hold at least one message", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens



# -- /v1/responses ------------------------------------------------------------------------------
class ResponseTextPart(_Body):
    """A text part of a Responses input message: the caller's text, or an earlier answer's
    passed back (its ``annotations``, citations, are carried along and not shown to the model)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None


class ResponseInputMessage(_Body):
    """A message item of ``input``. An earlier response's output item may be passed back as it
    came (``id``, ``status``: they name it and change nothing); other item types (tool calls,
    reasoning, images) are not accepted."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponseTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponseTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(_Body):
    format: ResponseTextFormat | None = None


# OpenAI Responses options this server cannot honour: accepted only at the values that ask for
# nothing (first), otherwise a 400 saying why (second)
NO_STORED_RESPONSES = "this server keeps no responses; send the whole conversation in input"
RESPONSES_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((None, []), "no tools on /v1/responses (/v1/chat/completions takes function tools)"),
    "tool_choice": ((None, "none", "auto"), "there are no tools to call on /v1/responses"),
    "previous_response_id": ((None,), NO_STORED_RESPONSES),
    "conversation": ((None,), NO_STORED_RESPONSES),
    "store": ((None, False), "this server keeps no responses to retrieve; send false or leave it out"),
    "background": ((None, False), "a background response is polled from storage, and none is kept"),
    "reasoning": ((None,), "the served model has no reasoning mode (effort, summaries)"),
    "include": ((None, []), "there is nothing extra to include (no reasoning, tool or logprob outputs)"),
    "truncation": ((None, "disabled"), "only 'disabled': an input beyond the context window is a 400"),
    "top_logprobs": ((None, 0), "no logprobs on /v1/responses (/v1/chat/completions returns them)"),
    "prompt": ((None,), "no stored prompt templates; send the text in input and instructions"),
}


class ResponsesRequest(GenerationFields):
    """``POST /v1/responses``: the chat engine path with the Responses API's fields."""

    input: list[ResponseInputMessage] | str
    instructions: str | None = None               # a leading system message
    max_output_tokens: int | None = Field(None, ge=1)
    text: ResponseTextConfig | None = None
    parallel_tool_calls: bool | None = None       # no tools, so nothing to call in parallel either way
    # refused unless neutral (RESPONSES_REFUSED)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for name, (neutral, why) in RESPONSES_REFUSED.items():
            value = getattr(self, name)
            if value not in neutral:
                shown = json.dumps(value, ensure_ascii=False)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise bad_request(f"{name} {shown} is not supported by this server: {why}", name)
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must hold at least one message", "input")

    def messages(self) -> list[ChatMessage]:
        """``instructions`` as a system message, then ``input`` (a string is one user message)."""
        items = self.input if isinstance(self.input, list) else [ResponseInputMessage(role="user", content=self.input)]
        system = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        return system + [ChatMessage(role=m.role, content=_joined(m.content)) for m in items]

    @property
    def text_format(self) -> ResponseTextFormat | None:
        return None if self.text is None else self.text.format

    def output_format(self) -> tuple[StructuredOutputs, str] | None:
        fmt = self.text_format
        if fmt is None:
            return None
        param = "text.format"
        if fmt.type != "json_schema" and (fmt.name, fmt.schema_, fmt.description, fmt.strict) != (None,) * 4:
            raise bad_request(f"{param}: name, schema, description and strict go with type json_schema", param)
        if fmt.type == "json_schema" and fmt.name is None:
            raise bad_request(f"{param} json_schema needs name", param)
        return _json_format(fmt.type, fmt.schema_, param, "schema")


_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "messages": "must be a list of {'role', 'content'} objects",
    "content": "must be a string or a list of {'type', 'text'} text parts",
    "input": "must be a string or a list of {'role', 'content'} message items",
    "tools": "must be a list of {'type': 'function', 'function': {'name', 'description', 'parameters'}} objects",
    "tool_choice": "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
}


def parse_body(model: type[_Body], body: bytes) -> Any:
    """Validate a JSON body; APIError(400) whose message names the first problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _api_error(e) from None


def _api_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    kind = err["type"]
    # a union's errors name the member tried ("str", "list[int]", "TextPart"): drop those
    loc = [str(x) for x in err["loc"] if not _is_union_member(str(x))]
    if kind == "json_invalid":
        return bad_request(f"malformed JSON body: {err['msg']}")
    if not loc:
        return bad_request("the request body must be a JSON object")
    field, where = loc[0], ".".join(loc)
    if kind == "extra_forbidden":
        return bad_request(f"unknown field {where!r}", where)
    if kind == "missing":
        return bad_request(f"{where} is required", field)
    if loc[-1] in _HINTS and (len(err["loc"]) > len(loc) or kind == "list_type"):
        return bad_request(f"{where} {_HINTS[loc[-1]]}", field)
    got = repr(err.get("input"))[:80]
    return bad_request(f"{where}: {err['msg'].lower()} (got {got})", field)


def _is_union_member(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper()


# -- the OpenAPI schema's answers -------------------------------------------------------------
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERROR_ANSWERS = {
    "400": "invalid request: the message and param name the problem",
    "401": "missing or invalid API key",
    "404": "unknown model, route or pin",
    "413": "body over the server's limit",
    "415": "body not declared application/json",
}


def json_body(model_name: str, ok: dict[str, Any] | None = None) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body (a model in the schema's components), the
    error answers it can give, each an ``{"error": {...}}`` object, and its 200 answer's schema
    ``ok`` when given."""
    error = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    out: dict[str, Any] = {
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model_name}"}}}},
        "responses": {status: {"description": text, **error} for status, text in ERROR_ANSWERS.items()}}
    if ok is not None:
        out["responses"]["200"] = {"description": "OK", "content": {"application/json": {"schema": ok}}}
    return out


def answers(ok: dict[str, Any]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route without a body: its 200 answer's schema, and 401."""
    error = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    return {"responses": {"200": {"description": "OK", "content": {"application/json": {"schema": ok}}},
                          "401": {"description": ERROR_ANSWERS["401"], **error}}}
