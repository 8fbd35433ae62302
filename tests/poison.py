"""An injected per-request failure: requests asking for the regex "poison" get a grammar
that raises on its third token. Tests of fault isolation install it on an engine, so they
keep proving isolation whatever the sampler fixes."""

from __future__ import annotations

import torch

POISON = {"structured_outputs": {"regex": "poison"}}


class PoisonedGrammar:
    def __init__(self) -> None:
        self.num_masks = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.num_masks += 1
        if self.num_masks == 3:
            raise RuntimeError("poisoned grammar")

    def accept(self, token_id: int) -> None:
        pass

    @property
    def is_finished(self) -> bool:
        return False


def install_poison(engine) -> int:
    """Make ``engine`` (an ``LLMEngine``) poison the requests that ask for it; 0 (so that a
    cluster's broadcast of it sums)."""
    grammars = engine.grammars
    real_check, real_matcher = grammars.check, grammars.matcher
    grammars.check = lambda spec: None if spec.regex == "poison" else real_check(spec)
    grammars.matcher = lambda spec: PoisonedGrammar() if spec.regex == "poison" else real_matcher(spec)
    return 0
