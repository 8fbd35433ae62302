"""Request bodies of the OpenAI API (pydantic) and the error every failure turns into.

Request models are strict (no "5" for 5, no true for 1) and forbid unknown fields, as the
OpenAI API does ("Unrecognized request argument"): a typo such as ``max_token`` is an error,
not a silently ignored option. OpenAI fields that do not change the output (``user``,
``metadata``, ``store``, ``service_tier``, ...) are accepted and ignored; fields this server
cannot honour (``suffix``, ``best_of != n``) are accepted only at their neutral value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvserve.blend.prompt import SegmentedPrompt
from kvserve.cache_control import MAX_SALT_CHARS
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


class _SamplingFields(_Body):
    """What completions and chat share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)          # vLLM's extension; 0 disables it
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1 - MAX_CHOICES)   # choice j uses seed + j
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                        # vLLM's extension, for benchmarks
    cache_priority: Literal["normal", "high"] | None = None   # kvserve's: the retention class of its blocks
    # vLLM's: blocks are shared only between requests with the same salt (docs/server.md "Tenants")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)      # vLLM's extension
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)                             # vLLM's extension
    speculate: bool = True       # kvserve's: false keeps this request out of speculative decoding (docs/spec.md)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None      # vLLM's extension
    # kvserve's: texts in the prompt (documents) whose KV is reused from a standalone
    # computation, wherever they appear, recomputing blend_fraction of them (lossy; docs/blend.md)
    segments: list[str] | None = Field(None, max_length=MAX_SEGMENTS)
    blend_fraction: float | None = None
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
            if self.blend_fraction is not None:
                raise bad_request("blend_fraction applies to segments; none were given", "blend_fraction")
            return None
        if not self.segments:
            raise bad_request("segments must hold at least one text", "segments")
        try:
            fraction = DEFAULT_BLEND_FRACTION if self.blend_fraction is None else check_blend_fraction(self.blend_fraction)
        except ValueError as e:
            raise bad_request(str(e), "blend_fraction") from None
        try:
            return SegmentedPrompt.from_text(text, self.segments, fraction)
        except ValueError as e:
            raise bad_request(f"segments: {e} ({param})", "segments") from None

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

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """The output constraint asked for, and the field that asked; 400 when more than one does."""
        asked: list[tuple[StructuredOutputs, str]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append((StructuredOutputs(json_object=True), "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
            asked.append((self._spec("response_format", json=rf.json_schema.schema_), "response_format"))
        so = self.structured_outputs
        if so is not None:
            asked.append((self._spec("structured_outputs", json=so.json_, regex=so.regex, choice=so.choice,
                                     grammar=so.grammar, json_object=bool(so.json_object)), "structured_outputs"))
        if len(asked) > 1:
            raise bad_request(f"give one output constraint, not {' and '.join(p for _, p in asked)}", asked[1][1])
        return asked[0] if asked else (None, None)

    @staticmethod
    def _spec(param: str, **fields: Any) -> StructuredOutputs:
        try:
            return StructuredOutputs(**fields)
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param) from None

    def sampling_params(self, choice: int, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutputs | None = None) -> SamplingParams:
        """The parameters of choice ``choice`` (its seed is ``seed + choice``), with the
        endpoint's own token limit, logprobs and output constraint; APIError(400) for values
        they refuse."""
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                seed=None if self.seed is None else self.seed + choice, stop=self.stop_strings(),
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logit_bias=tuple(self.logit_bias_ids().items()),
                min_tokens=self.min_tokens, structured=structured, speculate=self.speculate)
        except ValueError as e:
            raise bad_request(str(e)) from None


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
        content = self.content
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


_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "messages": "must be a list of {'role', 'content'} objects",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
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


def json_body(model_name: str) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body (a model in the schema's components) and the
    error answers it can give, each an ``{"error": {...}}`` object."""
    error = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    return {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model_name}"}}}},
            "responses": {status: {"description": text, **error} for status, text in ERROR_ANSWERS.items()}}
