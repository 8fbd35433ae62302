"""Per-request sampling parameters, validated when made."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``max_tokens=None`` lets a request run to the end of the context window.
    ``logprobs=k`` returns each generated token's logprob and the top ``k``
    alternatives; ``prompt_logprobs=k`` does the same for prompt tokens (and
    computes the whole prompt: such requests take no prefix-cache hits).
    ``kv_budget`` (tokens kept per layer) and ``kv_policy`` (a name from
    ``kvserve.kv.budget.policies.POLICIES``, checked when the engine admits the request)
    run the request under a KV budget; None takes the engine's (docs/budgets.md).
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
