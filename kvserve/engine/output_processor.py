"""After each sampled token: a request's text (decoded incrementally), its stop checks, its output.

The processor owns every running request's detokenizer state; the engine calls ``process``
after appending a token, ``make_output`` for each output, and ``remove`` when a request
finishes or is aborted.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import RequestOutput
from kvserve.model.tokenizer import Tokenizer
from kvserve.request import FinishReason, Request


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    num_searched_chars: int = 0     # committed text already searched for stop strings


class OutputProcessor:
    """Per-request text and stop conditions for one engine.

    Running outputs show the committed text less ``max(len(stop)) - 1`` characters when the
    request has stop strings, so a stop string that will be cut is never shown; finished ones
    show the final text (cut at the stop string, or the whole decode). Every output's text is
    a prefix of every later one's: a streamer sends ``text[len(sent):]``.
    """

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._states: dict[str, _TextState] = {}

    @property
    def num_requests(self) -> int:
        """Requests with text state: after every finish and abort is removed, 0."""
        return len(self._states)

    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        """Every request with text state is live (finished and aborted ones were removed)."""
        stale = self._states.keys() - set(live_request_ids)
        assert not stale, f"text state left for finished requests {sorted(stale)}"

    def add(self, req: Request) -> None:
        """Start ``req``'s text state (``process`` and ``make_output`` also start it on first use)."""
        self._state(req)

    def remove(self, request_id: str) -> None:
        """Drop the request's state (finished or aborted); unknown ids are ignored."""
        self._states.pop(request_id, None)

    def process(self, req: Request, token_id: int) -> FinishReason | None:
        """Advance ``req``'s text past ``token_id`` (already appended) and say whether it ends here.

        STOP when the grammar is complete; after ``min_tokens`` tokens, STOP on eos (unless
        ``ignore_eos``), on a stop token id or on a stop string (``req.stop_reason`` is set to
        it; for a string, ``req.output_text`` to the text cut there, the stop string kept with
        ``include_stop_str_in_output``); LENGTH at ``req.max_tokens`` or ``max_model_len``.
        A stop string is found once its last character is committed, over any number of
        tokens; one wholly within the first ``min_tokens`` tokens' text never stops it.
        """
        state = self._state(req)
        state.detokenizer.step(req.output_token_ids)
        p = req.params
        if req.constraint is not None and req.constraint.is_finished:
            return FinishReason.STOP   # the grammar allows nothing more
        can_stop = req.num_output_tokens >= p.min_tokens
        if can_stop and not p.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if can_stop and token_id in p.stop_token_ids:
            req.stop_reason = token_id
            return FinishReason.STOP
        if p.stop and self._find_stop_string(req, state, can_stop):
            return FinishReason.STOP
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def make_output(self, req: Request) -> RequestOutput:
        """``req``'s output now (see the class docstring for its text)."""
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        e2e = None if req.finish_time is None else req.finish_time - req.arrival_time
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, text=self._text(req),
            token_ids=list(req.output_token_ids), num_cached_tokens=req.num_cached_tokens or 0,
            finished=req.is_finished, finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            ttft=ttft, e2e_latency=e2e, num_preemptions=req.num_preemptions, error=req.error,
            error_kind=None if req.error_kind is None else req.error_kind.value,
            num_reused_tokens=req.num_reused_tokens, num_recomputed_tokens=req.num_recomputed_tokens,
            num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens)

    def _state(self, req: Request) -> _TextState:
        state = self._states.get(req.request_id)
        if state is None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)
            state = self._states[req.request_id] = _TextState(detokenizer)
        return state

    def _find_stop_string(self, req: Request, state: _TextState, can_stop: bool) -> bool:
        text = state.detokenizer.text
        searched, state.num_searched_chars = state.num_searched_chars, len(text)
        if not can_stop or len(text) == searched:
            return False
        p = req.params
        for s in p.stop:
            # only a match ending in the new text is new: the older text was searched before
            at = text.find(s, max(0, searched - len(s) + 1))
            if at >= 0:
                req.output_text = text[:at + len(s)] if p.include_stop_str_in_output else text[:at]
                req.stop_reason = s
                return True
        return False

    def _text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        if isinstance(req.stop_reason, str):
            return req.output_text     # cut at the stop string
        state = self._states.get(req.request_id)
        if req.is_finished:
            if state is None:          # removed already, or it failed before its first token
                return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
            return state.detokenizer.finish(req.output_token_ids)
        detokenizer = self._state(req).detokenizer
        detokenizer.step(req.output_token_ids)     # a no-op when process() saw these tokens
        text = detokenizer.text
        holdback = max((len(s) for s in req.params.stop), default=1) - 1
        return text[:max(0, len(text) - holdback)]
