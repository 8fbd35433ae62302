"""The end of a step: each row's token drawn, the drafts the target agrees with kept, the tokens
appended to their requests (stop checks and text: engine/output_processor.py) and the requests
they end retired. It holds every request not yet finished, by id."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestOutput
from kvserve.request import ConstraintError, ErrorKind, FinishReason, Request, Resumed, TokenLogprob
from kvserve.sampling.rows import RowRequest, drafted_rows
from kvserve.sampling.sampler import Sampler
from kvserve.scheduler.scheduler import Scheduler
from kvserve.speculative.speculator import Speculation

log = logging.getLogger("kvserve")


class TokenStage:
    def __init__(self, sampler: Sampler, scheduler: Scheduler, outputs: OutputProcessor,
                 speculator: Speculation) -> None:
        self.sampler, self.scheduler, self.outputs, self.speculator = sampler, scheduler, outputs, speculator
        self.requests: dict[str, Request] = {}      # every request queued and not yet finished

    def sample(self, logits: torch.Tensor, requests: list[Request],
                drafts: Sequence[tuple[int, ...]] | None = None) -> list[RequestOutput]:
        """Draw a token for each row and apply them: one row per request, or 1 + k for a request
        with k drafted tokens (row i as if the first i were appended: kvserve/sampling/rows.py),
        of which the run the target agrees with is accepted, then the target's own token
        (kvserve/speculative/speculator.py). A failure that belongs to one request (a row that gives no
        token, a grammar that rejects the token) fails that request only."""
        drafts = drafts if drafts is not None else [()] * len(requests)
        rows: list[RowRequest] = []
        undrawn: set[int] = set()     # a sampled request's drafted rows: speculative sampling draws them
        try:
            for req, draft in zip(requests, drafts):
                if draft and not req.params.is_greedy:
                    undrawn.update(range(len(rows), len(rows) + len(draft) + 1))
                rows += drafted_rows(req, draft, logits.shape[-1]) if draft else [req]
            sampled = self.sampler.sample(logits, rows, undrawn)
        except Exception as e:
            log.exception("sampling failed; failing its %d requests", len(requests))
            return [self.fail(r, f"sampling failed: {type(e).__name__}: {e}") for r in requests]
        outputs, first = [], 0
        for req, draft in zip(requests, drafts):
            own = range(first, first + len(draft) + 1)
            first += len(draft) + 1
            row_tokens = sampled.token_ids[own.start:own.stop]
            if row_tokens[0] is None:
                error = sampled.errors[own.start]
                outputs.append(self.fail(req, error.message, error.by_constraint))
                continue
            # a drafted row with no token (its grammar state failed, or another row error) is cut
            # off with the rows after it: the rows verified are the ones before it (if the run
            # reaches it, the next step meets the same failure, as plain decoding would)
            cut = next((j for j, t in enumerate(row_tokens) if t is None), None)
            checked = draft if cut is None else draft[:cut - 1]
            tokens = [t for t in row_tokens[:len(checked) + 1] if t is not None]
            try:
                emitted = (self.speculator.verify(sampled.logits[own.start:own.start + len(checked) + 1], req,
                                                  checked, tokens, self.sampler)
                           if checked else tokens)
                logprobs = self.sampler.logprobs(logits[own.start:own.start + len(emitted)],
                                                 rows[own.start:own.start + len(emitted)], list(emitted))
                reason = self.apply(req, emitted, [logprobs.get(j) for j in range(len(emitted))])
            except ConstraintError as e:       # its grammar failed on the token: the request's own input
                outputs.append(self.fail(req, str(e), by_constraint=True))
                continue
            except Exception as e:
                log.exception("request %s failed after sampling", req.request_id)
                outputs.append(self.fail(req, f"{type(e).__name__}: {e}"))
                continue
            if reason is not None:
                self.retire(req, reason)
            elif draft:
                self.scheduler.accept_draft(req, len(emitted) - 1)
            outputs.append(self.output(req))
        return outputs

    def apply(self, req: Request, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> FinishReason | None:
        """Append the tokens in order until one ends the request; its finish reason, if any."""
        for token_id, logprob in zip(token_ids, logprobs):
            if logprob is not None:
                req.output_logprobs.append(logprob)
            if req.constraint is not None:
                req.constraint.accept(token_id)
            req.append_token(token_id)
            reason = self.outputs.process(req, token_id)
            if reason is not None:
                return reason
        return None

    def retire(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        req.finish_time = time.monotonic()
        del self.requests[req.request_id]

    def fail(self, req: Request, error: str, by_constraint: bool = False) -> RequestOutput:
        """Finish ``req`` with FinishReason.ERROR (its blocks freed), as an output naming ``error``
        (its ``error_kind``: its output constraint's failure, or the engine's)."""
        req.error = error
        req.error_kind = ErrorKind.CONSTRAINT if by_constraint else ErrorKind.ENGINE
        self.retire(req, FinishReason.ERROR)
        return self.output(req)

    def output(self, req: Request) -> RequestOutput:
        out = self.outputs.make_output(req)
        if req.is_finished:
            self.forget(req.request_id)
        return out

    def forget(self, request_id: str) -> None:
        self.outputs.remove(request_id)
        self.speculator.forget(request_id)

    def resume(self, req: Request, resume: Resumed, vocab_size: int) -> None:
        """Append ``resume``'s tokens to ``req`` (not yet queued) as its own output; ValueError
        when they cannot be its output (out of range, beyond its length, rejected by its grammar,
        or ending it already), the request then never having existed."""
        tokens = resume.token_ids
        if len(tokens) >= req.max_tokens:
            raise ValueError(f"resume: {len(tokens)} tokens already reach the request's {req.max_tokens}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
               for t in tokens):
            raise ValueError(f"resume: token ids must be integers in [0, {vocab_size})")
        want = len(tokens) if req.params.logprobs is not None else 0
        if len(resume.logprobs) != want:
            raise ValueError(f"resume: {len(resume.logprobs)} logprobs for {len(tokens)} tokens; the request "
                             f"{'asks' if want else 'does not ask'} for logprobs ({want} expected)")
        try:
            reason = self.apply(req, list(tokens), list(resume.logprobs) or [None] * len(tokens))
            if reason is not None:
                raise ValueError(f"resume: the request already ended ({reason.value}) at token "
                                 f"{req.num_output_tokens} of {len(tokens)}")
        except Exception:
            self.outputs.remove(req.request_id)
            raise

    def check_integrity(self) -> None:
        self.outputs.check_integrity(self.requests)
