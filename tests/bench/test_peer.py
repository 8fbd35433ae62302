"""``kvserve bench peer``: llama.cpp's command lines and outputs (samples captured from its binaries,
trimmed), the kvserve side's timing on the tiny model with a clock that ticks per call, the table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from tiny import random_tokens, tiny_model

from kvserve.bench import peer, peer_llama, plots
from kvserve.bench.cli import add_bench_parser
from kvserve.bench.peer import Conditions, RowResult, Timed
from kvserve.bench.peer_llama import BatchedRecord, BenchRecord, LlamaError, LlamaFigure, LlamaPaths, Row
from kvserve.llm import LLM
from kvserve.model.loader import default_model_path

# llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 0 -n 4 -r 2 -t 1 -o jsonl (one line; keys trimmed)
BENCH_JSONL = (
    '{"build_commit": "0c1e570", "build_number": 1, "cpu_info": "Intel(R) Xeon(R) Processor", '
    '"model_type": "llama 256M Q4_1", "model_size": 96576768, "n_threads": 1, "type_k": "f16", "n_prompt": 0, '
    '"n_gen": 4, "n_depth": 0, "test_time": "2026-11-25T10:32:14Z", "avg_ns": 95674598, "stddev_ns": 970922, '
    '"avg_ts": 41.810533, "stddev_ts": 0.424301, "samples_ns": [ 94988052, 96361144 ],'
    '"samples_ts": [ 42.1106, 41.5105 ]}\n')

# llama-bench ... -p 0 -n 16 -r 2 -t 2 -o json (keys trimmed)
BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "model_size": 96576768,
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 16,
    "n_depth": 0,
    "avg_ns": 8773014620,
    "stddev_ns": 1920453135,
    "avg_ts": 1.868544,
    "stddev_ts": 0.409033,
    "samples_ns": [ 10130980052, 7415049189 ],
    "samples_ts": [ 1.57931, 2.15777 ]
  }
]
"""

# llama-batched-bench -m ... -npp 8 -ntg 4 -npl 1,2 -t 1 --output-format jsonl
BATCHED_JSONL = (
    '{"n_kv_max": 8192, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
    '"n_threads": 1, "n_threads_batch": 1, "pp": 8, "tg": 4, "pl": 1, "n_kv": 12, "t_pp": 0.074168, '
    '"speed_pp": 107.863235, "t_tg": 0.096957, "speed_tg": 41.255402, "t": 0.171125, "speed": 70.124184}\n'
    '{"n_kv_max": 8192, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
    '"n_threads": 1, "n_threads_batch": 1, "pp": 8, "tg": 4, "pl": 2, "n_kv": 24, "t_pp": 0.134161, '
    '"speed_pp": 119.259697, "t_tg": 0.132870, "speed_tg": 60.209225, "t": 0.267031, "speed": 89.877197}\n\n')

# the same without --output-format (its Markdown table)
BATCHED_MD = """
llama_batched_bench: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |      4 |    1 |     12 |    0.076 |   105.31 |    0.096 |    41.73 |    0.172 |    69.84 |
|     8 |      4 |    2 |     24 |    0.121 |   132.25 |    0.138 |    58.10 |    0.259 |    92.78 |

"""

# llama-batched-bench --version (on stderr)
VERSION = "version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0 for Linux x86_64\n"

BIN = Path("/opt/llama/bin")
MODEL = Path("/m/model.gguf")


# -- rows and command lines --------------------------------------------------------------------

def test_rows_in_table_order_with_depths_clipped_to_the_context():
    rows = peer_llama.make_rows(["prefill", "batched", "depth", "decode"], [4096, 8192], [8, 16], 8192)
    assert [(r.kind, r.num_seqs, r.num_prompt_tokens, r.num_decode_steps) for r in rows] == [
        ("decode", 1, 1, 128), ("depth", 1, 4096, 32), ("depth", 1, 8128, 32),
        ("batched", 8, 64, 128), ("batched", 16, 64, 128), ("prefill", 1, 512, 0)]
    assert [r.label for r in rows] == [
        "decode, batch 1", "decode, batch 1, depth 4096", "decode, batch 1, depth 8128",
        "batch 8, 64+128, whole run", "batch 16, 64+128, whole run", "prefill 512"]
    assert [r.llama_test for r in rows] == ["tg128", "tg32 @ d4096", "tg32 @ d8128", "S t/s, npl 8", "S t/s, npl 16",
                                            "pp512"]
    assert [r.num_counted_tokens for r in rows] == [128, 32, 32, 8 * 192, 16 * 192, 512]
    # two depths clipped to the same one run once
    assert [r.depth for r in peer_llama.make_rows(["depth"], [8150, 9000], [], 8192)] == [8128]


def test_unknown_rows_are_refused():
    with pytest.raises(ValueError, match="unknown rows bogus"):
        peer_llama.make_rows(["decode", "bogus"], [], [], 8192)


def test_command_line_of_each_row():
    rows = {r.label: r for r in peer_llama.make_rows(list(peer_llama.ROW_KINDS), [4096], [8], 8192)}
    head = [str(BIN / "llama-bench"), "-m", str(MODEL), "-t", "2", "-r", "3"]

    def command(label: str) -> list[str]:
        row = rows[label]
        binary = BIN / ("llama-batched-bench" if row.kind == "batched" else "llama-bench")
        return peer_llama.llama_command(binary, row, MODEL, 2, 3)

    assert command("decode, batch 1") == head + ["-p", "0", "-n", "128", "-o", "jsonl"]
    assert command("decode, batch 1, depth 4096") == head + ["-p", "0", "-n", "32", "-d", "4096", "-o", "jsonl"]
    assert command("prefill 512") == head + ["-p", "512", "-n", "0", "-o", "jsonl"]
    assert command("batch 8, 64+128, whole run") == [
        str(BIN / "llama-batched-bench"), "-m", str(MODEL), "-t", "2", "-npp", "64", "-ntg", "128", "-npl", "8",
        "--output-format", "jsonl"]
    # --llama-args: more of llama.cpp's flags, after the model and threads, for both binaries
    decode = rows["decode, batch 1"]
    assert peer_llama.llama_command(BIN / "llama-bench", decode, MODEL, 2, 3, ["-fa", "1"]) == (
        head[:5] + ["-fa", "1"] + head[5:] + ["-p", "0", "-n", "128", "-o", "jsonl"])


def test_each_row_takes_its_binary():
    paths = LlamaPaths(BIN / "llama-bench", None)
    assert paths.binary(Row("decode", 1, 1, 4)) == BIN / "llama-bench"
    assert paths.binary(Row("prefill", 1, 8, 0)) == BIN / "llama-bench"
    assert paths.binary(Row("batched", 2, 8, 4)) is None


# -- parsing llama.cpp's output ----------------------------------------------------------------

def test_llama_bench_jsonl_and_json_parse_alike():
    assert peer_llama.parse_llama_bench("log line\n" + BENCH_JSONL) == [
        BenchRecord(0, 4, 0, 41.810533, 0.424301, (42.1106, 41.5105), "0c1e570", 96576768)]
    assert peer_llama.parse_llama_bench(BENCH_JSON) == [
        BenchRecord(0, 16, 0, 1.868544, 0.409033, (1.57931, 2.15777), "0c1e570", 96576768)]
    assert peer_llama.parse_llama_bench("| model | size |\nbuild: 0c1e570 (1)\n") == []


def test_bench_figure_is_the_rows_test_as_llama_prints_it():
    records = peer_llama.parse_llama_bench(BENCH_JSONL)
    assert peer_llama.bench_figure(records, Row("decode", 1, 1, 4)) == LlamaFigure(41.810533, 0.424301, 2,
                                                                             (42.1106, 41.5105), 96576768)
    with pytest.raises(LlamaError, match=r"no tg4 @ d4096 test \(found: p0 n4 d0\)"):
        peer_llama.bench_figure(records, Row("depth", 1, 4096, 4))
    with pytest.raises(LlamaError, match=r"no pp512 test \(found: none\)"):
        peer_llama.bench_figure([], Row("prefill", 1, 512, 0))


def test_batched_bench_jsonl_and_markdown():
    assert peer_llama.parse_batched_bench(BATCHED_JSONL) == [BatchedRecord(8, 4, 1, 0.171125, 70.124184),
                                                       BatchedRecord(8, 4, 2, 0.267031, 89.877197)]
    assert peer_llama.parse_batched_bench(BATCHED_MD) == [BatchedRecord(8, 4, 1, 0.172, 69.84),
                                                    BatchedRecord(8, 4, 2, 0.259, 92.78)]


def test_s_ts_is_every_prompt_and_generated_token_over_the_whole_time():
    for r in peer_llama.parse_batched_bench(BATCHED_JSONL):
        assert r.speed == pytest.approx(r.pl * (r.pp + r.tg) / r.t_s, rel=1e-5)
        assert Row("batched", r.pl, r.pp, r.tg).num_counted_tokens == r.pl * (r.pp + r.tg)


def test_batched_figure_is_mean_and_sample_sd_over_runs():
    row = Row("batched", 2, 8, 4)
    runs = [peer_llama.parse_batched_bench(BATCHED_JSONL), [BatchedRecord(8, 4, 2, 0.2, 90.0)],
            [BatchedRecord(8, 4, 2, 0.2, 100.0)]]
    figure = peer_llama.batched_figure(runs, row)
    assert (figure.mean_tok_s, figure.num_runs, figure.samples_tok_s) == (
        pytest.approx(93.292399), 3, (89.877197, 90.0, 100.0))
    assert figure.sd_tok_s == pytest.approx(5.80928, abs=1e-5)   # sqrt(67.4954 / 2)
    assert peer_llama.batched_figure(runs[1:2], row) == LlamaFigure(90.0, 0.0, 1, (90.0,))
    with pytest.raises(LlamaError, match="no line for npp 8, ntg 4, npl 16"):
        peer_llama.batched_figure(runs, Row("batched", 16, 8, 4))


def test_version_and_cpu_model():
    assert peer.parse_version(VERSION) == "0.5.0-dev (build 1, commit 0c1e570)"
    assert peer.parse_version("usage: llama-bench\n") is None
    cpuinfo = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t: fpu\n"
    assert peer.cpu_model(cpuinfo) == "Intel(R) Xeon(R) Processor"
    assert peer.cpu_model("") == "unknown"


# -- running llama.cpp -------------------------------------------------------------------------

def test_run_llama_returns_stdout():
    assert peer_llama.run_llama([sys.executable, "-c", "print('[]')"]) == "[]\n"


def test_a_failing_run_names_the_command_and_its_stderr_tail():
    script = ("import sys; print('loading', file=sys.stderr); "
              "print('error: unable to load model', file=sys.stderr); sys.exit(3)")
    command = [sys.executable, "-c", script]
    with pytest.raises(LlamaError) as e:
        peer_llama.run_llama(command)
    assert str(e.value).startswith(f"{command[0]} -c ")
    assert "failed: exit status 3; stderr ends:\nloading\nerror: unable to load model" in str(e.value)


def test_a_segfault_says_so():
    with pytest.raises(LlamaError, match="killed by SIGSEGV .*AMX build"):
        peer_llama.run_llama([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])


def test_a_missing_binary_and_a_timeout_are_llama_errors(tmp_path):
    with pytest.raises(LlamaError, match="cannot run"):
        peer_llama.run_llama([str(tmp_path / "llama-bench"), "--help"])
    with pytest.raises(LlamaError, match="ran past 1 s"):
        peer_llama.run_llama([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=1)


# -- the model must be the GGUF llama.cpp reads ------------------------------------------------

def test_only_a_gguf_file_is_accepted(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="same GGUF file, and .* is a Hugging Face directory"):
        peer.gguf_path(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="same GGUF file: .* is not a GGUF file"):
        peer.gguf_path(str(tmp_path / "model.safetensors"))
    assert peer.gguf_path(None) == default_model_path()


# -- the kvserve side on the tiny model --------------------------------------------------------

class Ticker:
    """A clock that moves one second per reading: a timed span of one step reads 1.0."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def test_decode_times_only_the_decode_steps(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=32, max_num_batched_tokens=16, enable_prefix_caching=False)
    # a 40-token prompt prefills in 3 chunks of 16 (the third gives token 1), then 5 decode steps
    assert peer.time_decode(llm, random_tokens(40, seed=1), 5, clock=Ticker()) == Timed(5, 5.0, 5)
    assert llm.engine.num_steps == 8
    assert peer.time_decode(llm, [3], 7, clock=Ticker()) == Timed(7, 7.0, 7)
    assert llm.engine.num_steps == 8 + 1 + 7
    llm.engine.check_integrity()


def test_decode_refuses_a_context_that_cannot_hold_the_steps(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=40, max_model_len=48, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="2 decode steps instead of 5: the engine's max_model_len 48 cannot hold "
                                         "45 \\+ 6 tokens"):
        peer.time_decode(llm, random_tokens(45, seed=2), 5, clock=Ticker())


def test_a_batch_counts_every_prompt_token_and_decode_pass_over_the_whole_run(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=64, enable_prefix_caching=False)
    prompts = [random_tokens(8, seed=s) for s in range(3)]
    # one prefill step for the three prompts, then 4 decode passes: 5 tokens each; two clock readings
    assert peer.time_batch(llm, prompts, 4, clock=Ticker()) == Timed(3 * (8 + 4), 1.0, 5)
    # no decode steps: a prefill (max_tokens 1)
    assert peer.time_batch(llm, [random_tokens(12, seed=9)], 0, clock=Ticker()) == Timed(12, 1.0, 1)


def test_row_prompts(loaded):
    text = list(range(1000))
    assert peer.row_prompts(Row("decode", 1, 1, 4), text, bos_id=7) == [[7]]
    assert peer.row_prompts(Row("decode", 1, 1, 4), text, bos_id=None) == [[0]]
    assert peer.row_prompts(Row("depth", 1, 300, 4), text, bos_id=7) == [list(range(300))]
    batch = peer.row_prompts(Row("batched", 3, 64, 4), text, bos_id=7)
    assert batch == [list(range(64, 128)), list(range(128, 192)), list(range(192, 256))]
    with pytest.raises(ValueError, match="the text has 1000 tokens, prefill 512 needs 1024"):
        peer.row_prompts(Row("prefill", 1, 512, 0), text, bos_id=7)


def test_run_row_alternates_and_reads_llama_figures(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=64, enable_prefix_caching=False)
    paths = LlamaPaths(BIN / "llama-bench", BIN / "llama-batched-bench")
    calls: list[tuple[str, int]] = []

    def fake_llama(command):
        calls.append((Path(command[0]).name, llm.engine.num_steps))
        if command[0].endswith("llama-batched-bench"):
            return BATCHED_JSONL
        return BENCH_JSONL

    row = Row("batched", 2, 8, 4)
    result = peer.run_row(llm, row, [random_tokens(8, seed=1), random_tokens(8, seed=2)], paths, MODEL, 2, 3,
                          run=fake_llama)
    # a warm-up of 5 steps, then llama-batched-bench before each of kvserve's three runs
    assert calls == [("llama-batched-bench", 5), ("llama-batched-bench", 10), ("llama-batched-bench", 15)]
    assert [t.num_tokens for t in result.kvserve] == [2 * 12] * 3
    assert result.llama is not None
    assert result.llama._replace(mean_tok_s=0.0) == LlamaFigure(0.0, 0.0, 3, (89.877197,) * 3)
    assert result.llama.mean_tok_s == pytest.approx(89.877197)
    assert len(result.llama_commands) == 3

    calls.clear()
    result = peer.run_row(llm, Row("decode", 1, 1, 4), [[5]], paths, MODEL, 2, 2, run=fake_llama)
    assert calls == [("llama-bench", 20 + 5)]         # after the warm-up (5 steps), once with -r 2
    assert result.llama == LlamaFigure(41.810533, 0.424301, 2, (42.1106, 41.5105), 96576768)
    assert [t.num_steps for t in result.kvserve] == [4, 4]
    assert result.llama_commands == (" ".join(peer_llama.llama_command(paths.bench, Row("decode", 1, 1, 4), MODEL, 2, 2)),)

    # variants of llama-bench's flags: each runs, the fastest is the row's figure
    slower = BENCH_JSONL.replace('"avg_ts": 41.810533', '"avg_ts": 20.0')

    def by_flags(command):
        return slower if "-fa" in command and command[command.index("-fa") + 1] == "1" else BENCH_JSONL
    tried = peer.run_row(llm, Row("decode", 1, 1, 4), [[5]], paths, MODEL, 2, 2, run=by_flags,
                         variants=[["-fa", "1"], ["-fa", "0"]])
    assert tried.llama is not None and tried.llama.mean_tok_s == pytest.approx(41.810533)
    assert "-fa 0" in tried.llama_commands[0]

    alone = peer.run_row(llm, row, [random_tokens(8, seed=1), random_tokens(8, seed=2)], LlamaPaths(None, None),
                         MODEL, 2, 2, run=fake_llama)
    assert (alone.llama, alone.ratio, len(alone.kvserve)) == (None, None, 2)


# -- the report --------------------------------------------------------------------------------

def results() -> list[RowResult]:
    return [RowResult(Row("decode", 1, 1, 128), (Timed(128, 2.0, 128), Timed(128, 1.0, 128), Timed(128, 1.6, 128)),
                      LlamaFigure(100.0, 2.5, 3, (97.5, 100.0, 102.5), 1_000_000)),
            # llama.cpp reads a quarter of kvserve's weight bytes (kvserve's --weight-format native)
            RowResult(Row("depth", 1, 4096, 32), (Timed(32, 1.0, 32),), LlamaFigure(80.0, 1.0, 3, (79.0, 80.0, 81.0),
                                                                                    250_000)),
            RowResult(Row("batched", 8, 64, 128), (Timed(1536, 8.0, 130),), None),
            RowResult(Row("prefill", 1, 512, 0), (Timed(512, 0.5, 1), Timed(512, 0.25, 1)),
                      LlamaFigure(1000.0, 10.0, 2, (990.0, 1010.0)))]


def test_median_spread_and_ratio_in_the_table():
    text = peer.render(results(), bandwidth=400e6, weight_nbytes=1_000_000)
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "row", "llama.cpp test", "llama.cpp tok/s (mean ± sd, runs)", "kvserve tok/s (median)",
        "kvserve spread (runs)", "kvserve / llama.cpp", "bandwidth limit tok/s", "llama.cpp of limit",
        "kvserve of limit"]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert cells == [
        ["decode, batch 1", "tg128", "100.00 ± 2.50 (3)", "80.00", "64.00-128.00 (3)", "0.80x", "400.0", "25%", "20%"],
        ["decode, batch 1, depth 4096", "tg32 @ d4096", "80.00 ± 1.00 (3)", "32.00", "32.00-32.00 (1)", "0.40x",
         "400.0 / 1600.0", "5%", "8%"],
        ["batch 8, 64+128, whole run", "S t/s, npl 8", "-", "192.00", "192.00-192.00 (1)", "-", "-", "-", "-"],
        ["prefill 512", "pp512", "1000.00 ± 10.00 (2)", "1536.00", "1024.00-2048.00 (2)", "1.54x", "-", "-", "-"]]


def test_header_states_the_conditions():
    c = Conditions("m.Q4_1.gguf", "gguf", "fp32 (torch.float32)", 2, 2, "Intel(R) Xeon(R) Processor",
                   "2026-11-25 11:00", 40e9, 100 * 2**20, "0.5.0-dev (build 1, commit 0c1e570)")
    assert c.header() == (
        "kvserve bench peer: m.Q4_1.gguf; kvserve weights gguf, KV fp32 (torch.float32); llama.cpp 0.5.0-dev "
        "(build 1, commit 0c1e570) (KV f16, its defaults); 2 threads (this machine has 2 cores); CPU Intel(R) "
        "Xeon(R) Processor; 2026-11-25 11:00; read bandwidth 40.0 GB/s, weights read per decode pass 100.0 MiB: "
        "limit 381.5 tok/s")
    assert "llama.cpp not run" in c._replace(llama_version=None).header()


def test_absent_columns_are_said_in_a_line():
    both = LlamaPaths(BIN / "llama-bench", BIN / "llama-batched-bench")
    assert peer.absent_line(both, peer_llama.ROW_KINDS) is None
    assert peer.absent_line(LlamaPaths(None, None), ["decode", "batched", "prefill"]) == (
        "llama.cpp columns absent: rows decode, prefill need --llama-bench PATH; "
        "rows batched need --llama-batched-bench PATH")
    assert peer.absent_line(LlamaPaths(None, both.batched_bench), ["batched"]) is None


def test_cli_parses_and_the_plot_is_a_png(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "peer", "--llama-bench", "/x/llama-bench", "--weight-format", "native",
                              "--rows", "decode,prefill", "--plot", str(tmp_path / "p.png")])
    assert (args.threads, args.repeats, args.depths, args.batches, args.weight_format, args.rows) == (
        2, 3, "4096,8192", "8,16", "native", "decode,prefill")
    assert args.run is peer.run_bench
    path = tmp_path / "peer.png"
    rows = peer.plot_rows(results(), 400e6, 1_000_000)
    assert [(r["limit_tok_s"], r["ratio"]) for r in rows] == [(400.0, 0.8), (400.0, 0.4), (None, None),
                                                               (None, 1.536)]
    assert plots.plot_peer(rows, path) == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
