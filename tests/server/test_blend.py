"""Segments over HTTP: the ``segments``, ``blend_fraction`` and per-prompt selection fields on
completions and chat,
their errors, the blend metrics. The default model, blending always on (no cost model) so
every segmented request takes the blend path."""

from __future__ import annotations

import httpx
import pytest
from live_server import MODEL, running_server

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
DOC_A = ("The lighthouse keeper on Marrow Island kept a logbook of every passing ship, noting the weather, "
         "the flags they flew and the hour they rounded the point. In the winter of the great storm he wrote "
         "that the sea had risen higher than any keeper before him had recorded.")
DOC_B = ("Mina Osk runs the harbour bakery. Her rye loaves sell out before eight each morning, and the fishermen "
         "buy her seed rolls by the dozen before they sail. The bakery's oven is older than the harbour wall.")


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model, blend_cost_model=False) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_completions_with_segments_reuse_them(server, http):
    prompt = f"Notes:\n{DOC_A}\n{DOC_B}\nQuestion: who runs the bakery? Answer:"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "segments": [DOC_A, DOC_B], "blend_fraction": 0.2}
    before = server.metric("kvserve_blend_reused_tokens_total")
    first = http.post(CMPL, json=body)
    assert first.status_code == 200, first.text
    again = http.post(CMPL, json={**body, "prompt": f"Other notes first.\n{DOC_B}\n{DOC_A}\nWho runs the bakery?",
                                  "segments": [DOC_B, DOC_A]})     # in the order they occur
    assert again.status_code == 200, again.text
    assert server.metric("kvserve_blend_requests_total") >= 2
    assert server.metric("kvserve_blend_reused_tokens_total") > before
    assert server.metric("kvserve_segment_stored_tokens_total") > 0


def test_chat_with_segments(server, http):
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "segments": [DOC_A],
            "messages": [{"role": "user", "content": f"{DOC_A}\n\nWhat did the keeper record?"}]}
    before = server.metric("kvserve_blend_requests_total")
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert server.metric("kvserve_blend_requests_total") == before + 1


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "abc", "segments": ["xyz"]}, "segments", "does not occur"),
    ({"prompt": [1, 2, 3], "segments": ["x"]}, "segments", "text prompt"),
    ({"prompt": "abc", "blend_fraction": 0.3}, "blend_fraction", "none were given"),
    ({"prompt": "abc", "segments": []}, "segments", "at least one"),
    ({"prompt": "abc", "segments": ["abc"], "blend_fraction": 1.5}, "blend_fraction", ""),
    ({"prompt": "abc", "segments": ["b"], "echo": True, "logprobs": 1}, "segments", "echo"),
    ({"prompt": "abc", "blend_selection": "query"}, "blend_selection", "none were given"),
    ({"prompt": "abc", "segments": ["b"], "blend_selection": "best"}, "blend_selection", "unknown blend selection"),
    ({"prompt": "abc", "segments": ["b"], "blend_sink_tokens": -2}, "blend_sink_tokens", "got -2"),
    ({"prompt": "abc", "segments": ["b"], "blend_last_segments": -1}, "blend_last_segments", "got -1"),
])
def test_bad_segments_get_a_400(http, body, param, words):
    r = http.post(CMPL, json={"model": MODEL, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]
    ok = http.post(CMPL, json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200


def test_a_prompts_own_selection_acts(server, http):
    """``blend_last_segments`` covering every segment recomputes every reused token, where the
    engine's options (none whole) at the same fraction recompute a share of them."""
    prompt = f"Notes:\n{DOC_B}\n{DOC_A}\nQuestion: what did the keeper record? Answer:"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "segments": [DOC_B, DOC_A],
            "blend_fraction": 0.1}
    deltas = []
    for extra in ({}, {"blend_last_segments": 2, "blend_selection": "query-segments", "blend_sink_tokens": 4}):
        reused = server.metric("kvserve_blend_reused_tokens_total")
        recomputed = server.metric("kvserve_blend_recomputed_tokens_total")
        r = http.post(CMPL, json={**body, **extra})
        assert r.status_code == 200, r.text
        deltas.append((server.metric("kvserve_blend_reused_tokens_total") - reused,
                       server.metric("kvserve_blend_recomputed_tokens_total") - recomputed))
    (reused, recomputed), (reused_whole, recomputed_whole) = deltas
    assert reused == reused_whole > 0
    assert 0 < recomputed < reused and recomputed_whole == reused_whole
