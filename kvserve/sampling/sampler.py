"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

A row that cannot give a token (NaN logits, every token masked, a grammar that failed)
fails its own request: ``sample`` reports it by row and draws the other rows as usual.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from types import ModuleType
from typing import NamedTuple

import torch

from kvserve.request import Request, TokenLogprob
from kvserve.sampling.processors import RowError, process_logits
from kvserve.sampling.rows import RowRequest


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Each row's chosen token logprob and its top ``k`` alternatives.

    logprobs: [n, vocab] log-softmax rows; token_ids: the chosen token per row.
    """
    chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()
    if k > 0:
        vals, idx = logprobs.topk(k, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [() for _ in token_ids]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def row_max(logits: torch.Tensor, kernels: ModuleType | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(dim=-1)``, bit for bit (each row's maximum and the first index holding it):
    by ``kernels`` (the model's C++ extension, kvserve/model/csrc/rowmax.h) where given and the
    logits are a contiguous float32 CPU matrix (10x torch's scalar loop over a 152k vocabulary),
    torch's for the rows holding a NaN and elsewhere."""
    if (kernels is None or logits.device.type != "cpu" or logits.dim() != 2 or logits.dtype != torch.float32
            or not logits.is_contiguous()):
        return logits.max(dim=-1)
    top, argmax, rest = kernels.row_argmax(logits)
    if bool(rest.any()):
        rows = rest.nonzero()[:, 0]
        top[rows], argmax[rows] = logits[rows].max(dim=-1)
    return top, argmax


class Sampled(NamedTuple):
    token_ids: list[int | None]     # None for a row that failed
    errors: dict[int, RowError]     # row -> why it has no token
    logits: torch.Tensor            # the rows after penalties, bias and grammar (what was drawn from)


class Sampler:
    def __init__(self, seed: int, eos_token_ids: Collection[int] = (), kernels: ModuleType | None = None) -> None:
        """``kernels``: the model's C++ extension (``row_max``), where the engine has it loaded."""
        self._generator = torch.Generator().manual_seed(seed)
        self._eos_token_ids = tuple(eos_token_ids)
        self._kernels = kernels

    def sample(self, logits: torch.Tensor, requests: Sequence[RowRequest], undrawn: Collection[int] = ()) -> Sampled:
        """One token per row of ``logits`` ([n, vocab], float32, on CPU), after each request's
        penalties, bias and grammar (kvserve/sampling/processors.py). ``undrawn``: rows checked
        but not drawn from (speculative sampling draws them, ``verify_draft``): their token is
        the argmax."""
        logits, errors = process_logits(logits, requests, self._eos_token_ids)
        # one pass over the vocabulary finds every odd row: a row's max is NaN when it holds
        # a NaN, +inf when it holds +inf, -inf when every token is masked
        top, argmax = row_max(logits, self._kernels)
        odd = (~torch.isfinite(top)).nonzero()[:, 0].tolist()
        if odd:
            logits = logits.clone()   # the caller's logits stay the model's (logprobs read them)
        for i in odd:
            value = top[i].item()
            if math.isnan(value):
                errors.setdefault(i, RowError("the model produced NaN logits"))
            elif value < 0:
                by_grammar = requests[i].constraint is not None
                errors.setdefault(i, RowError("no token is allowed at this position"
                                              + (" by the output constraint" if by_grammar else ""), by_grammar))
            else:   # +inf is the limit of a logit: the tokens holding it share all the probability
                logits[i] = torch.where(torch.isposinf(logits[i]), 0.0, float("-inf"))
        token_ids: list[int | None] = list(argmax.tolist())
        for row, req in enumerate(requests):
            if row in errors:
                token_ids[row] = None
            elif not req.params.is_greedy and row not in undrawn:
                try:
                    token_ids[row] = self._sample_row(logits[row], req)
                except RuntimeError as e:   # torch's complaint about this row's distribution
                    errors[row], token_ids[row] = RowError(f"sampling failed: {e}"), None
        return Sampled(token_ids, errors, logits)

    @staticmethod
    def logprobs(logits: torch.Tensor, requests: Sequence[RowRequest],
                 token_ids: list[int | None]) -> dict[int, TokenLogprob]:
        """Row -> the drawn token's logprob and the top alternatives, for each row whose request
        asks for logprobs and got a token: the model's own distribution (``logits`` as the
        model gave them, before penalties, bias and grammar), as in vLLM."""
        chosen = [(i, t) for i, t in enumerate(token_ids) if t is not None and requests[i].params.logprobs is not None]
        if not chosen:
            return {}
        logprobs = torch.log_softmax(logits[[i for i, _ in chosen]], dim=-1)
        return {i: top_logprobs(logprobs[k:k + 1], [t], requests[i].params.logprobs or 0)[0]
                for k, (i, t) in enumerate(chosen)}

    def _sample_row(self, logits: torch.Tensor, req: RowRequest) -> int:
        return self._draw(self.probs(logits, req), req)

    def _draw(self, probs: torch.Tensor, req: RowRequest) -> int:
        return int(torch.multinomial(probs, 1, generator=self._generator_of(req)).item())

    def _generator_of(self, req: RowRequest) -> torch.Generator:
        """The request's own (seeded) generator, else the engine's."""
        return req.generator if req.generator is not None else self._generator

    def verify_draft(self, logits: torch.Tensor, req: Request, draft: Sequence[int]) -> list[int]:
        """Speculative sampling of a sampled request's rows (``logits`` [k + 1, vocab] for
        ``draft``'s k tokens): drafted token i is kept with probability p_i(d_i) (a proposer
        that drafts one token for sure: min(1, p / q) with q = 1), and at the first one
        rejected a token is drawn from p_i with d_i removed (the residual max(0, p - q),
        renormalized); after k kept ones, from p_k. The tokens this gives are distributed
        exactly as drawing from the target one token at a time. Returns the kept drafts and
        the drawn token."""
        gen = self._generator_of(req)
        kept: list[int] = []
        for i, token in enumerate(draft):
            probs = self.probs(logits[i], req)
            if torch.rand((), generator=gen).item() < probs[token].item():
                kept.append(token)
                continue
            residual = probs.clone()
            residual[token] = 0.0
            mass = residual.sum()
            if mass <= 0:       # p_i(d_i) rounded to 1 and the draw still missed it: keep it
                kept.append(token)
                continue
            return [*kept, self._draw(residual / mass, req)]
        return [*kept, self._draw(self.probs(logits[len(draft)], req), req)]

    def probs(self, logits: torch.Tensor, req: RowRequest) -> torch.Tensor:
        """The distribution a sampled request draws its token from: ``logits`` (one row, already
        processed) scaled by temperature, filtered by top-k and top-p, softmaxed."""
        p = req.params
        scaled = logits / p.temperature
        if 0 < p.top_k < scaled.shape[-1]:
            kth = scaled.topk(p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = scaled.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p; the first always stays
            # (a tiny top_p rounds to 0 in float32, which would otherwise drop every token)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            drop[0] = False
            scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        return scaled.softmax(-1)
