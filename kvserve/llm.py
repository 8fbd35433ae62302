"""The Python API: ``LLM(...).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Self

from kvserve.blend.prompt import SegmentedPrompt
from kvserve.cache_control import CacheControl
from kvserve.engine.engine import LLMEngine
from kvserve.engine.model_card import Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.kv.pins import Clock, PinInfo
from kvserve.model.loader import LoadedModel
from kvserve.offload.base import Transport
from kvserve.options import engine_config
from kvserve.request import DEFAULT_BLEND_FRACTION, EncodedPrompt
from kvserve.sampling.sampler import Sampler
from kvserve.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """A model with a paged, prefix-cached KV cache. ``options``: the engine options
    (kvserve/options.py; README "Engine options"), e.g. ``num_kv_blocks=64``.

    >>> llm = LLM()                                   # SmolLM2-135M-Instruct
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].text, out[0].num_cached_tokens
    """

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None,
                 tiers: Sequence[Transport] | None = None, clock: Clock | None = None,
                 draft: LoadedModel | None = None, timer: Clock | None = None, sampler: Sampler | None = None,
                 **options: Any) -> None:
        """``clock``: seconds for pin retention times (tests step a fake one; default monotonic).
        ``draft``: the speculative ``draft`` method's model, loaded; ``timer``: what times the
        steps and tier reads the cost models learn from (default perf_counter; LLMEngine's docstring);
        ``sampler``: one to draw tokens instead of the engine's own (LLMEngine's docstring)."""
        config = engine_config(model, **options)
        self.engine = LLMEngine(config, loaded, tiers, clock if clock is not None else time.monotonic, draft,
                                timer if timer is not None else time.perf_counter, sampler)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, cache: CacheControl | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts.

        All prompts are validated before any is queued, so a bad one raises
        ValueError and leaves the engine untouched. ``cache``: every prompt's retention
        class and pinned prefixes (kvserve/cache_control.py). A ``SegmentedPrompt``'s
        segments are reused by blending (kvserve/blend/prompt.py; lossy, opt-in).
        """
        prompt_list: list[Prompt]
        if isinstance(prompts, (str, SegmentedPrompt, EncodedPrompt)) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if not prompt_list:
            raise ValueError("no prompts given")
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        prios = list(priority) if priority is not None else [0] * len(prompt_list)
        encoded = [self.engine.encode(prompt) for prompt in prompt_list]    # each tokenized once, here
        for prompt, sp in zip(encoded, param_list):
            self.engine.checks.check_request(prompt, sp)
        ids = [self.engine.add_request(p, sp, priority=pr, cache=cache)
               for p, sp, pr in zip(encoded, param_list, prios)]
        return self._run(ids)

    def chat(self, messages: list[Message] | list[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             cache: CacheControl | None = None, segments: Sequence[str] | None = None,
             blend_fraction: float = DEFAULT_BLEND_FRACTION, blend_selection: str | None = None,
             blend_sink_tokens: int | None = None, blend_last_segments: int | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate.
        ``segments``: texts (documents) in every conversation whose KV is reused by blending
        (``SegmentedPrompt.from_text``, with the ``blend_*`` arguments; lossy, opt-in)."""
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        if not conversations or not all(conversations):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        texts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        prompts: list[Prompt] = list(texts) if segments is None else \
            [SegmentedPrompt.from_text(t, segments, blend_fraction, blend_selection, blend_sink_tokens,
                                       blend_last_segments) for t in texts]
        return self.generate(prompts, params, cache=cache)

    def cache_segments(self, segments: Sequence[str | Sequence[int]], salt: str = "") -> int:
        """Store segments' standalone KV ahead of the prompts that reuse them (text or token
        ids, each a segment as ``Segment`` would mark it) for the requests of cache salt ``salt``;
        returns the tokens newly stored."""
        return self.engine.cache_segments(segments, salt)

    # -- pins --------------------------------------------------------------
    def pin(self, prompt: Prompt | list[Message], ttl_s: float | None = None, num_tokens: int | None = None,
            warm: bool = True) -> PinInfo:
        """Pin a prefix (text, token ids, or chat messages rendered without the generation
        prompt, e.g. a system prompt) for ``ttl_s`` seconds (default 300): its blocks are
        evicted after every unpinned block and demoted to the offload tiers when they must go.
        With ``warm`` the blocks not cached yet are computed now (a one-token generation).
        ValueError (``PinLimitError`` past ``max_pinned_fraction``) changes nothing."""
        ids = self._prefix_ids(prompt)
        info = self.engine.pin(ids, ttl_s, num_tokens)
        if warm and info.num_device_blocks < len(info.block_keys):
            self.generate([ids[:info.num_tokens]], SamplingParams(max_tokens=1, temperature=0.0))
            info = self.engine.pin(ids, ttl_s, num_tokens)   # the same pin: its device blocks now
        return info

    def unpin(self, prompt: Prompt | list[Message], num_tokens: int | None = None) -> PinInfo:
        """Remove the pin over exactly this prefix (``PinNotFoundError`` when there is none)."""
        return self.engine.unpin(self._prefix_ids(prompt), num_tokens)

    def pins(self) -> list[PinInfo]:
        """Every pin, soonest to expire first."""
        return self.engine.list_pins()

    def _prefix_ids(self, prompt: Prompt | list[Message]) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer, so no chat template")
            prompt = self.engine.tokenizer.apply_chat_template(prompt, add_generation_prompt=False)
        return self.engine.encode(prompt).token_ids  # type: ignore[arg-type]

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        while wanted - done.keys():
            if not self.engine.has_unfinished:
                raise RuntimeError(f"requests {sorted(wanted - done.keys())} left the engine unfinished")
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return [done[r] for r in request_ids]

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Release the offload tiers (see LLMEngine.close)."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
