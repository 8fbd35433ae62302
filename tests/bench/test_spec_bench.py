"""``kvserve bench spec``'s workloads and row names (the runs themselves need a real model)."""

from __future__ import annotations

from kvserve.bench.spec import RENAMES, code_edit_prompts, config_name


def test_code_edit_prompts_ask_a_rename_of_the_shipped_file():
    prompts = code_edit_prompts(5)
    assert len(prompts) == 5
    for i, messages in enumerate(prompts):
        content = messages[0]["content"]
        old, new = RENAMES[i % len(RENAMES)]
        assert f"Rename the class {old} to {new}" in content
        assert f"class {old}" in content and content.count("\n") > 120


def test_configs_are_named_by_method_k_and_the_keys_they_set():
    assert config_name('{"method": "ngram", "num_speculative_tokens": 4}') == "ngram k=4"
    assert config_name('{"method": "suffix", "suffix_min_prob": 0.3}') == "suffix k=4 suffix_min_prob=0.3"
