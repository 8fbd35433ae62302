"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from kvserve.request import Request, TokenLogprob


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


class Sampler:
    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One token per row of ``logits`` ([n, vocab], float32, on CPU)."""
        token_ids = logits.argmax(dim=-1).tolist()
        for row, req in enumerate(requests):
            if not req.params.is_greedy:
                token_ids[row] = self._sample_row(logits[row], req)
        return token_ids

    def _sample_row(self, logits: torch.Tensor, req: Request) -> int:
        p = req.params
        scaled = logits / p.temperature
        if p.top_k > 0 and p.top_k < scaled.shape[-1]:
            kth = scaled.topk(p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = scaled.sort(descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            # drop a token when the mass before it already reaches top_p (the first always stays)
            drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
            scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = scaled.softmax(-1)
        gen = req.generator if req.generator is not None else self._generator
        return int(torch.multinomial(probs, 1, generator=gen).item())
