"""OutputProcessor: text decoded incrementally, stop checks, held-back running text; the
default model's real tokenizer, requests fed one token at a time as the engine does."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

import pytest

from kvserve.engine.detokenizer import REPLACEMENT_CHAR
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestOutput
from kvserve.model.tokenizer import Tokenizer
from kvserve.request import FinishReason, Request, RequestStatus
from kvserve.sampling_params import SamplingParams

PROMPT = [1, 2, 3]
MAX_MODEL_LEN = 8192
JAPANESE = "吾輩は猫である。名前はまだ無い。"
MULTI_BYTE = JAPANESE + "🎉👍🏽 naïve café 😀😀 “quotes” … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🇯🇵"
MAX_IDS_PER_STEP = 12    # 3 * (3 held tokens + 1): the bound tests/engine/test_detokenizer.py explains


class CountingTokenizer:
    """The real tokenizer, counting the ids the processor decodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_token_ids = tokenizer.special_token_ids
        self.num_decoded_ids = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.num_decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class FinishedGrammar:
    is_finished = True


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    assert default_model.tokenizer is not None
    return default_model.tokenizer


@pytest.fixture
def processor(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer, frozenset({tokenizer.eos_token_id}), MAX_MODEL_LEN)


def botchan() -> str:
    return resources.files("kvserve").joinpath("data/botchan.txt").read_text(encoding="utf-8")


def run(processor: OutputProcessor, ids: list[int], params: SamplingParams,
        max_tokens: int | None = None, req: Request | None = None) -> tuple[Request, list[RequestOutput]]:
    """Feed ``ids`` as the engine does, until the request finishes or they run out."""
    req = req or Request("r", list(PROMPT), params, 0, max_tokens=max_tokens or len(ids))
    outputs = []
    for token_id in ids:
        req.append_token(token_id)
        reason = processor.process(req, token_id)
        if reason is not None:    # as Scheduler.finish does
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
        outputs.append(processor.make_output(req))
        if reason is not None:
            processor.remove(req.request_id)
            break
    return req, outputs


def streamed(outputs: list[RequestOutput]) -> list[str]:
    """The deltas a streamer sends; each output's text must extend the last one's."""
    deltas, sent = [], ""
    for out in outputs:
        assert out.text.startswith(sent), (sent[-20:], out.text[-20:])
        deltas.append(out.text[len(sent):])
        sent = out.text
    return deltas


def test_4096_tokens_stream_the_full_decode_in_constant_work_a_step(tokenizer):
    text_ids, multi_ids = tokenizer.encode(botchan()), tokenizer.encode(MULTI_BYTE)
    ids: list[int] = []
    for start in range(0, 4096, 40):
        ids += text_ids[start:start + 40] + multi_ids[:4 + start % 37]
    ids = ids[:4096]
    final = tokenizer.decode(ids)
    counting = CountingTokenizer(tokenizer)
    processor = OutputProcessor(counting, frozenset(), MAX_MODEL_LEN)     # type: ignore[arg-type]
    req = Request("r", list(PROMPT), SamplingParams(stop=("never in botchan",)), 0, max_tokens=len(ids))
    outputs, ids_per_step = [], []
    for n, token_id in enumerate(ids, 1):
        before = counting.num_decoded_ids
        req.append_token(token_id)
        reason = processor.process(req, token_id)
        if reason is not None:
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
        outputs.append(processor.make_output(req))
        ids_per_step.append(counting.num_decoded_ids - before)
        if n % 64 == 0 and n < len(ids):     # 15 characters held back for the stop string, and the incomplete one
            assert len(outputs[-1].text) <= len(tokenizer.decode(ids[:n]).rstrip(REPLACEMENT_CHAR)) - 15
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert max(ids_per_step) <= MAX_IDS_PER_STEP and sum(ids_per_step) <= 4 * len(ids)
    # every running text is a prefix of the next and so of the final one: none ends in half a
    # character completed later (the final text's U+FFFDs are the cut multi-byte slices' bytes)
    deltas = streamed(outputs)
    assert "".join(deltas) == outputs[-1].text == final
    assert sum(not d for d in deltas) >= 100     # steps that ended inside a character sent nothing


def split_inside(tokenizer: Tokenizer, ids: list[int], start: int, end: int) -> bool:
    """Whether some token ends strictly inside text[start:end] (mid-character included)."""
    for k in range(1, len(ids)):
        prefix = tokenizer.decode(ids[:k])
        if start < len(prefix.rstrip(REPLACEMENT_CHAR)) < end or (
                prefix.endswith(REPLACEMENT_CHAR) and start <= len(prefix) - 1 < end):
            return True
    return False


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("text", "stop"), [(botchan()[:200], "STER DARLI"), (JAPANESE, "猫である")])
def test_a_stop_string_split_over_tokens_cuts_the_text(tokenizer, processor, text, stop, include):
    ids = tokenizer.encode(text)
    at = text.index(stop)
    assert split_inside(tokenizer, ids, at, at + len(stop))
    if stop.isascii():   # starts inside 'MAS' and ends inside 'ING': no token boundary at either end
        assert text[:at] not in {tokenizer.decode(ids[:k]) for k in range(len(ids))}
        assert text[:at + len(stop)] not in {tokenizer.decode(ids[:k]) for k in range(len(ids))}
    last_token = next(k for k in range(len(ids)) if len(tokenizer.decode(ids[:k + 1])) >= at + len(stop)
                      and not tokenizer.decode(ids[:k + 1]).endswith(REPLACEMENT_CHAR))
    params = SamplingParams(stop=("never", stop), include_stop_str_in_output=include, max_tokens=None)
    req, outputs = run(processor, ids, params)
    assert req.finish_reason is FinishReason.STOP and req.stop_reason == stop == outputs[-1].stop_reason
    assert len(outputs) == last_token + 1 == len(outputs[-1].token_ids)
    assert outputs[-1].text == (text[:at + len(stop)] if include else text[:at])
    deltas = streamed(outputs)
    assert "".join(deltas) == outputs[-1].text
    assert all(stop not in out.text for out in outputs[:-1])
    assert processor.num_requests == 0
    assert processor.make_output(req).text == outputs[-1].text     # after remove too


def test_a_stop_string_within_min_tokens_does_not_stop(tokenizer, processor):
    text = "stop here, then stop again"
    ids = tokenizer.encode(text)
    req, outputs = run(processor, ids, SamplingParams(stop=("stop",), min_tokens=3))
    assert req.finish_reason is FinishReason.STOP and outputs[-1].text == "stop here, then "


def test_stop_token_ids(tokenizer, processor):
    ids = tokenizer.encode("One, two, three, four, five")
    stop_id = ids[4]
    assert stop_id not in ids[:4]
    req, outputs = run(processor, ids, SamplingParams(stop_token_ids=(stop_id,)))
    assert req.finish_reason is FinishReason.STOP and req.stop_reason == stop_id == outputs[-1].stop_reason
    assert outputs[-1].text == tokenizer.decode(ids[:5]) == "One, two, three"


@pytest.mark.parametrize(("ignore_eos", "min_tokens", "num_tokens", "reason"),
                         [(False, 0, 3, FinishReason.STOP), (False, 5, 7, FinishReason.STOP),
                          (True, 0, 10, FinishReason.LENGTH)])
def test_eos(tokenizer, processor, ignore_eos, min_tokens, num_tokens, reason):
    eos = tokenizer.eos_token_id
    words = tokenizer.encode(" a b c d e f g h")
    ids = [*words[:2], eos, *words[2:5], eos, *words[5:8]]
    params = SamplingParams(ignore_eos=ignore_eos, min_tokens=min_tokens, max_tokens=None)
    req, outputs = run(processor, ids, params)
    assert req.finish_reason is reason and req.stop_reason is None and len(outputs) == num_tokens
    assert outputs[-1].text == tokenizer.decode(ids[:num_tokens])     # the eos is a special token: skipped
    _, kept = run(processor, ids, SamplingParams(skip_special_tokens=False))
    assert kept[-1].text == tokenizer.decode(ids[:3], skip_special_tokens=False)
    assert kept[-1].text.endswith(tokenizer.decode([eos], skip_special_tokens=False))


def test_length_at_max_tokens_and_at_the_context_window(tokenizer, processor):
    ids = tokenizer.encode("One, two, three, four, five")
    req, outputs = run(processor, ids, SamplingParams(), max_tokens=5)
    assert req.finish_reason is FinishReason.LENGTH and outputs[-1].text == tokenizer.decode(ids[:5])
    short = OutputProcessor(tokenizer, frozenset(), len(PROMPT) + 3)
    req, outputs = run(short, ids, SamplingParams())
    assert req.finish_reason is FinishReason.LENGTH and len(outputs) == 3 and outputs[-1].finish_reason == "length"


def test_a_finished_grammar_stops(tokenizer, processor):
    ids = tokenizer.encode("{}")
    req = Request("g", list(PROMPT), SamplingParams(), 0, max_tokens=8)
    req.constraint = FinishedGrammar()    # type: ignore[assignment]
    req, outputs = run(processor, ids, req.params, req=req)
    assert req.finish_reason is FinishReason.STOP and len(outputs) == 1


def test_running_text_holds_back_a_possible_stop_string(tokenizer, processor):
    ids = tokenizer.encode("One, two, three")
    req, outputs = run(processor, ids, SamplingParams(stop=("three!",)), max_tokens=100)
    assert not req.is_finished and outputs[-1].text == "One, two, "    # 5 characters held back
    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
    assert processor.make_output(req).text == "One, two, three"
    processor.remove(req.request_id)
    assert processor.num_requests == 0


def test_no_tokenizer_gives_no_text():
    processor = OutputProcessor(None, frozenset({0}), MAX_MODEL_LEN)
    req, outputs = run(processor, [5, 6, 7, 0], SamplingParams(stop=("x",)))
    assert req.finish_reason is FinishReason.STOP and [o.text for o in outputs] == ["", "", "", ""]
