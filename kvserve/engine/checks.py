"""What this engine can run: the checks of a request's parameters and prompt, before it is queued."""

from __future__ import annotations

from kvserve.kv.budget.budgets import Budgets
from kvserve.kv.budget.policies import get_policy
from kvserve.request import EncodedPrompt
from kvserve.sampling.structured import GrammarCompiler
from kvserve.sampling_params import SamplingParams

#: why a model with sliding-window layers runs neither (kvserve/model/gemma3.py)
SLIDING_NO_BUDGETS = ("a model with sliding-window layers keeps only its windows' blocks in those layers already, "
                      "and its budgets are not built: a compaction would move entries off the positions a window "
                      "is counted in")
SLIDING_NO_BLEND = ("segmented prompts (blending) are not run on models with sliding-window layers yet: blending "
                    "re-rotates reused keys by one RoPE base and attends every layer over the whole context, and "
                    "this model's layers differ in both")


class RequestChecks:
    def __init__(self, budgets: Budgets, grammars: GrammarCompiler, vocab_size: int,
                 has_sliding_layers: bool = False) -> None:
        self.budgets = budgets
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.has_sliding_layers = has_sliding_layers

    def check_params(self, params: SamplingParams) -> None:
        """ValueError for parameters this engine cannot run: an unknown KV budget policy, a KV
        budget it cannot apply, a token id outside the vocabulary, a grammar that does not compile."""
        if params.kv_policy is not None:
            get_policy(params.kv_policy)
        self.budgets.check(params)
        for token_id, _ in params.logit_bias:
            if token_id >= self.vocab_size:
                raise ValueError(f"logit_bias: token id {token_id} is out of range for a vocabulary of "
                                 f"{self.vocab_size}")
        if params.structured is not None:
            self.grammars.check(params.structured)

    def check_request(self, prompt: EncodedPrompt, params: SamplingParams) -> None:
        """``check_params``, and what a segmented prompt cannot run with (ValueError)."""
        self.check_params(params)
        if prompt.blend is None:
            return
        if self.has_sliding_layers:
            raise ValueError(SLIDING_NO_BLEND)
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need every prompt token computed; a segmented prompt reuses "
                             "its segments' KV (send it as plain text instead)")
        if self.budgets.max_blocks(params, len(prompt.token_ids)) is not None:
            raise ValueError("a KV budget and a segmented prompt do not mix: budgets compact a full-precision "
                             "cache computed token by token")
