"""Decode throughput at several batch sizes, kvserve vs transformers ``generate``.

Both run the same weights in the same dtype on the same device, in one process,
alternating run by run (so a noisy neighbour slows both alike), each timed as the
median of ``repeats`` runs after a warm-up. Each
request has the same short prompt and generates exactly ``new_tokens`` tokens
(eos ignored); throughput = batch * new_tokens / wall time (prefill included).

transformers' cache is its default (dynamic) or, with ``hf_cache="static"``, its static cache
(``cache_implementation="static"``: preallocated, the baseline a GPU's decode is held to). A
model without a tokenizer (``--random-model``, kvserve/bench/random_model.py) gets a prompt of
random ids as long as the text's.
"""

from __future__ import annotations

import torch

from kvserve.bench.common import hf_model_from, median_times, table
from kvserve.bench.random_model import random_token_ids
from kvserve.llm import LLM
from kvserve.model.loader import LoadedModel
from kvserve.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
PROMPT_TOKENS = 18       # about the text's length in SmolLM2's tokens: a model without a tokenizer's
HF_CACHES = ("dynamic", "static")


def run(loaded: LoadedModel, llm: LLM, batch_sizes: list[int], new_tokens: int,
        repeats: int, hf_cache: str = "dynamic") -> tuple[list[list[object]], str]:
    if hf_cache not in HF_CACHES:
        raise ValueError(f"hf_cache must be one of {', '.join(HF_CACHES)}, got {hf_cache!r}")
    engine = llm.engine
    hf = hf_model_from(loaded, engine.dtype, engine.device)
    cache = {"cache_implementation": "static"} if hf_cache == "static" else {}
    prompt = (engine.encode_prompt(PROMPT) if loaded.tokenizer is not None
              else random_token_ids(PROMPT_TOKENS, loaded.config.vocab_size))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for bs in batch_sizes:
        ids = torch.tensor([prompt] * bs, device=engine.device)
        mask = torch.ones_like(ids)

        def ours(bs: int = bs) -> None:
            llm.reset_prefix_cache()   # every run prefills, as transformers does
            llm.generate([prompt] * bs, params)

        def theirs(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> None:
            with torch.inference_mode():
                hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=0, **cache)

        t_ours, t_hf = median_times([ours, theirs], repeats)
        tps_ours = bs * new_tokens / t_ours
        tps_hf = bs * new_tokens / t_hf
        rows.append([bs, f"{tps_ours:.1f}", f"{tps_hf:.1f}", f"{tps_ours / tps_hf:.2f}x"])
    text = table(["batch", "kvserve tok/s", "transformers tok/s", "kvserve / transformers"], rows)
    return rows, text
