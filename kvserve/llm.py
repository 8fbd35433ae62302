"""The Python API: ``LLM(...).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.model.loader import LoadedModel
from kvserve.offload.base import Transport
from kvserve.options import engine_config
from kvserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """A model with a paged, prefix-cached KV cache. ``options``: the engine options
    (kvserve/options.py; README "Engine options"), e.g. ``num_kv_blocks=64``.

    >>> llm = LLM()                                   # SmolLM2-135M-Instruct
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].text, out[0].num_cached_tokens
    """

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None,
                 tiers: Sequence[Transport] | None = None, **options: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **options), loaded, tiers)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts.

        All prompts are validated before any is queued, so a bad one raises
        ValueError and leaves the engine untouched.
        """
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
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
        for prompt in prompt_list:
            self.engine.encode_prompt(prompt)
        for sp in param_list:
            self.engine.check_params(sp)
        ids = [self.engine.add_request(p, sp, priority=pr) for p, sp, pr in zip(prompt_list, param_list, prios)]
        return self._run(ids)

    def chat(self, messages: list[Message] | list[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate."""
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        if not conversations or not all(conversations):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        prompts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in conversations]
        return self.generate(prompts, params)

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
