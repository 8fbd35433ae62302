"""Per-request sampling parameters, validated when made."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5     # below this a temperature is greedy: 1/T would overflow the logits
MAX_LOGIT_BIAS = 100.0        # as the OpenAI API


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the generated text, enforced while sampling (kvserve/sampling/structured.py).

    Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text), ``json_object``
    (any JSON object), ``regex``, ``choice`` (one of these strings), ``grammar`` (a Lark
    grammar, as llguidance reads it). The schema is stored as JSON text. Whether the schema,
    regex or grammar compiles is checked by the engine when the request is added.
    """

    json: str | Mapping[str, Any] | None = None   # stored as JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        schema: Any = self.json
        if schema is not None and not isinstance(schema, str):
            if not isinstance(schema, (Mapping, bool)):
                raise ValueError(f"structured json must be a JSON schema object, got {type(schema).__name__}")
            object.__setattr__(self, "json", json.dumps(dict(schema) if isinstance(schema, Mapping) else schema))
        elif isinstance(schema, str):
            try:
                json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured json is not valid JSON: {e}") from None
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured {name} must be a non-empty string")
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        """The one constraint given: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) is greedy. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``max_tokens=None`` lets a request run to the end of the context window.
    ``logprobs=k`` returns each generated token's logprob and the top ``k``
    alternatives; ``prompt_logprobs=k`` does the same for prompt tokens (and
    computes the whole prompt: such requests take no prefix-cache hits).
    ``kv_budget`` (tokens kept per layer) and ``kv_policy`` (a name from
    ``kvserve.kv.budget.policies.POLICIES``, checked when the engine admits the request)
    run the request under a KV budget; None takes the engine's (docs/budgets.md).

    Penalties act on the logits before sampling: ``presence_penalty`` subtracts a constant
    from every token already generated, ``frequency_penalty`` that much per occurrence (both in
    [-2, 2], as the OpenAI API); ``repetition_penalty`` divides the positive logits (multiplies
    the negative ones) of every token in the prompt or the output (CTRL's; 1 is off).
    ``logit_bias`` adds a bias in [-100, 100] to token ids (a mapping, stored as sorted pairs).
    ``min_tokens``: eos and ``stop_token_ids`` cannot end the output, nor stop strings cut
    it, before that many tokens. ``structured``: a ``StructuredOutputs`` constraint (with
    one, the grammar decides when the output ends and ``min_tokens`` does not hold it back).
    ``speculate=False``: this request never takes drafted tokens, on an engine that speculates.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    kv_budget: int | None = None
    kv_policy: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredOutputs | None = None
    speculate: bool = True

    def __post_init__(self) -> None:
        # accept lists and a single stop string, store tuples (the object is frozen)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.kv_budget is not None and (not isinstance(self.kv_budget, int) or isinstance(self.kv_budget, bool)
                                           or self.kv_budget < 1):
            raise ValueError(f"kv_budget must be a positive number of tokens, got {self.kv_budget!r}")
        self._check_logits_options()

    def _check_logits_options(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10] (1 is off), got {self.repetition_penalty!r}")
        bias: Any = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        try:
            normalized = tuple(sorted((int(t), float(b)) for t, b in pairs))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r:.200}") from None
        object.__setattr__(self, "logit_bias", normalized)
        for token_id, b in normalized:
            if token_id < 0 or not math.isfinite(b) or abs(b) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: token id {token_id} -> {b}: ids must be >= 0 and biases in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise ValueError(f"structured must be a StructuredOutputs, got {type(self.structured).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
