"""KV budgets under quantized KV formats, on the tiny model: a compaction (and ArkVale's recalls)
rewrites the kept entries through the format's codecs (whole blocks encoded again where the format
encodes whole blocks, the open block's front in its residual row), and every backend reads the
result in place."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.kv.budget.budgets import KVBudgets
from kvserve.kv.budget.policies import POLICIES
from kvserve.kv.budget.state import BudgetState, SlotReader, TokenPlan
from kvserve.request import Request

FORMATS = ["int8", "fp8", "kivi2g8", "k=kivi4g8,v=int8", "int4g8+out2", "int8+had", "0=fp16;1-=kivi2g8"]


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def prompt(n: int = 200) -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(128) for _ in range(n)]


def budget_for(policy: str) -> int:
    """40 tokens (the block after the kept entries is open again), or a multiple of the block
    (16) where the policy keeps whole blocks."""
    return 64 if POLICIES[policy].is_paged else 40


def run(llm: LLM, params: SamplingParams) -> list[int]:
    """Generate, checking the engine's books after every step."""
    llm.engine.add_request(prompt(), params)
    tokens: list[int] = []
    while llm.engine.has_unfinished:
        for out in llm.engine.step():
            if out.finished:
                tokens = out.token_ids
        llm.engine.check_integrity()
    return tokens


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_budgeted_request_gives_the_same_tokens_on_the_cpu_kernel_and_the_torch_path(loaded, fmt, policy,
                                                                                      monkeypatch):
    """Every policy in every format: the cpu kernel (in place, scoring where it scores) and the
    torch path give the same tokens, and so does the masked reference (each layer's valid slots
    gathered and masked by hand); compactions happen, blocks come back, every residual row is
    free at the end."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, kv_budget=budget_for(policy),
                            kv_policy=policy)
    got = {}
    for backend in ("torch", "cpu", "reference"):
        if backend == "reference":
            monkeypatch.setattr(BudgetState, "is_dense", property(lambda self: False))
            monkeypatch.setattr(BudgetState, "block_holes", property(lambda self: None))
        llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64, kv_format=fmt,
                  attention_backend="torch" if backend == "reference" else backend)
        got[backend] = run(llm, params)
        kv = llm.engine.kv
        assert kv.budgets.num_compactions >= 3     # the prompt's, then two in decode at least
        assert kv.num_free_blocks == kv.num_blocks
        assert kv.residual.num_free_rows == kv.residual.num_rows
    assert got["torch"] == got["cpu"] == got["reference"] and len(got["torch"]) == 40


@pytest.mark.parametrize("fmt", ["kivi2g8", "int8", "int4g8+out2"])
def test_a_compaction_stores_the_kept_entries_as_the_format_encodes_them(loaded, fmt, monkeypatch):
    """After snapkv keeps 40 of 100 tokens (block 16): slots 0-31, two whole blocks, read back as
    the codec encodes the kept keys and values; slots 32-39 are the front of the open block, held
    exactly in its residual row by a half that encodes whole blocks (KIVI's), as the codec stores
    each token by one that stores tokens on their own (which is then what was kept: decoded and
    encoded again, such a token is stored as it was)."""
    seen: list[tuple[TokenPlan, list[int]]] = []
    apply = KVBudgets.apply

    def recording(self: KVBudgets, request: Request, plan: TokenPlan, block_ids: list[int]) -> None:
        apply(self, request, plan, block_ids)
        seen.append((plan, list(block_ids)))

    monkeypatch.setattr(KVBudgets, "apply", recording)
    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=128, kv_format=fmt)
    llm.engine.add_request(prompt(100), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                       kv_budget=40, kv_policy="snapkv"))
    storage = llm.engine.kv.budgets.storage
    bs = storage.block_size
    while not seen:
        llm.engine.step()
    plan, table = seen[0]
    assert plan.num_slots == 40 and len(table) == 3
    assert storage.residual.num_rows == 0 or storage.residual.row_of(table[2]) is not None
    reader = SlotReader(storage, table, bs, storage.device)
    for layer in range(storage.num_layers):
        k, v = reader.read(layer, 40)
        fmt_layer = storage.format.layers[layer]
        for got, kept, codec, rows in ((k, plan.keys[layer], fmt_layer.key, storage.key_residual[layer]),
                                       (v, plan.values[layer], fmt_layer.value, storage.value_residual[layer])):
            assert kept.shape[0] == 40
            blocks = kept[:32].reshape(2, bs, *kept.shape[1:])
            assert torch.equal(got[:32], codec.decode(codec.encode(blocks), torch.float32).flatten(0, 1))
            front = kept[32:40]
            if rows is not None:        # KIVI's keys: the open block's front exactly, from its row
                assert torch.equal(got[32:40], front)
                # the kept entries came from other blocks: encoded again, they move (not a vacuous check)
                assert not torch.equal(got[:32], kept[:32])
            else:
                assert torch.equal(got[32:40], codec.decode(codec.encode(front.unsqueeze(1)), torch.float32)[:, 0])
                # a token stored on its own, decoded and encoded again, is stored as it was: such a
                # half loses nothing to a compaction
                assert torch.equal(got, kept)
