"""What a request returns."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.request import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    num_cached_tokens: int          # prompt tokens served from the prefix cache
    finished: bool
    finish_reason: str | None       # "stop", "length", "abort", "error"; None while running
    stop_reason: str | int | None   # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None   # first entry is None (no context)
    ttft: float | None              # seconds from arrival to the first token
    e2e_latency: float | None       # seconds from arrival to finish
    num_preemptions: int
    error: str | None = None        # with finish_reason "error": what failed (this request only)
    error_kind: str | None = None   # ... and whose failure: "constraint" (its output constraint) or "engine"
    num_reused_tokens: int = 0      # blended prompt: tokens whose KV came from stored segments
    num_recomputed_tokens: int = 0  # of those, recomputed (kvserve/blend/)
    num_draft_tokens: int = 0       # speculative decoding: drafted tokens checked (kvserve/speculative/)
    num_accepted_tokens: int = 0    # of those, accepted

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
