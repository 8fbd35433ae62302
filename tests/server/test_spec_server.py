"""Speculative decoding over HTTP: the same text as a plain server, the ``speculate`` field, the
counters on /metrics (the default model; prompt lookup on a prompt that quotes itself)."""

from __future__ import annotations

import httpx
from live_server import MODEL, running_server

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
PROMPT = ("Copy this list exactly.\nred, green, blue, yellow, purple, orange, black, white, grey, pink\n"
          "red, green, blue, yellow, purple, orange, black, white, grey, pink\nred, green, blue,")
METRIC = 'kvserve_spec_draft_tokens_total{method="ngram"}'


def complete(url: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_speculating_server_gives_the_plain_text_and_counts_drafts(default_model):
    with running_server(default_model) as plain:
        want = complete(plain.url).json()["choices"][0]["text"]
        assert plain.metric(METRIC) == 0.0      # no counters without speculation
    with running_server(default_model, speculative_config=NGRAM) as spec:
        got = complete(spec.url)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want
        drafted = spec.metric(METRIC)
        assert drafted > 0 and spec.metric('kvserve_spec_accepted_tokens_total{method="ngram"}') > 0
        opted_out = complete(spec.url, speculate=False)
        assert opted_out.json()["choices"][0]["text"] == want and spec.metric(METRIC) == drafted
        bad = complete(spec.url, speculate="yes")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculate"
