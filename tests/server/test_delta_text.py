"""DeltaText sends what follows the text sent: the engine already held back what it may cut."""

from __future__ import annotations

from kvserve.engine.output_processor import OutputProcessor
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.server.serving import DeltaText


def test_sends_the_new_suffix():
    delta = DeltaText()
    assert [delta.next(t) for t in ["", "Hel", "Hel", "Hello", "Hello, world"]] == ["", "Hel", "", "lo",
                                                                                         ", world"]
    assert delta.next("Hello, world") == "" and delta.num_sent_chars == len("Hello, world")


def test_streams_the_engine_outputs_without_the_stop_string(default_model):
    tokenizer = default_model.tokenizer
    processor = OutputProcessor(tokenizer, frozenset(), 4096)
    params = SamplingParams(stop=("four",), max_tokens=None)
    req = Request("r", [1], params, 0, max_tokens=64)
    delta, sent = DeltaText(), []
    for token_id in tokenizer.encode("One, two, three, four, five"):
        req.append_token(token_id)
        reason = processor.process(req, token_id)
        if reason is not None:
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
        out = processor.make_output(req)
        sent.append(delta.next(out.text))
        if out.finished:
            break
    assert "".join(sent) == "One, two, three, " and all("four" not in s for s in sent)
    assert out.finish_reason == "stop" and out.stop_reason == "four"
