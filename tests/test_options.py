"""Engine options: one source (config field metadata) for keywords, flags and the README."""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING
from pathlib import Path

import pytest

from kvserve.config import CacheConfig, DiskConfig, EngineConfig, HostConfig, RedisConfig, SchedulerConfig
from kvserve.options import OPTIONS, CommandDefault, add_engine_args, engine_config, engine_options
from kvserve.scheduler.policies import POLICIES

README = Path(__file__).resolve().parents[1] / "README.md"

# option -> (the flag's arguments, the keyword's value, the field's value); a new option needs a row
SAMPLES = {
    "device": (["cpu"], "cpu", "cpu"),
    "dtype": (["float16"], "float16", "float16"),
    "max_model_len": (["100"], 100, 100),
    "max_model_len_fit": (["lower"], "lower", "lower"),
    "seed": (["7"], 7, 7),
    "attention_backend": (["torch"], "torch", "torch"),
    "linear_backend": (["torch"], "torch", "torch"),
    "weight_format": (["int4-g64+out8"], "int4-g64+out8", "int4-g64+out8"),
    "block_size": (["32"], 32, 32),
    "kv_cache_memory_gb": (["0.5"], 0.5, 1 << 29),
    "num_kv_blocks": (["12"], 12, 12),
    "enable_prefix_caching": ([], False, False),
    "window_kv": ([], False, False),
    "cache_salt": (["s1"], "s1", "s1"),
    "key_secret_file": (["/tmp/secret"], "/tmp/secret", "/tmp/secret"),
    "kv_format": (["int8"], "int8", "int8"),
    "kv_budget": (["64"], 64, 64),
    "kv_policy": (["arkvale-w0.25"], "arkvale-w0.25", "arkvale-w0.25"),
    "kv_budget_host_gb": (["0.5"], 0.5, 1 << 29),
    "blend_cost_model": ([], False, False),
    "blend_select_layer": (["3"], 3, 3),
    "blend_selection": (["query"], "query", "query"),
    "blend_sink_tokens": (["32"], 32, 32),
    "blend_last_segments": (["1"], 1, 1),
    "blend_query_layer": (["18"], 18, 18),
    "blend_preamble": (["You are a helpful assistant."], "You are a helpful assistant.", "You are a helpful assistant."),
    "blend_in_steps": ([], False, False),
    "blend_in_batch": ([], False, False),
    "max_pinned_fraction": (["0.25"], 0.25, 0.25),
    "max_pin_ttl_s": (["60"], 60.0, 60.0),
    "max_num_batched_tokens": (["128"], 128, 128),
    "max_num_seqs": (["8"], 8, 8),
    "enable_chunked_prefill": ([], False, False),
    "scheduling_policy": (["fcfs"], "fcfs", "fcfs"),
    "max_wait_steps": (["5"], 5, 5),
    "host_cache_gb": (["2"], 2, 2 << 30),
    "disk_cache_dir": (["/tmp/kvserve-blocks"], "/tmp/kvserve-blocks", "/tmp/kvserve-blocks"),
    "disk_cache_gb": (["3"], 3, 3 << 30),
    "disk_fsync": ([], False, False),
    "redis_url": (["redis://h:6379/0"], "redis://h:6379/0", "redis://h:6379/0"),
    "redis_ttl_s": (["9"], 9.0, 9.0),
    "redis_timeout_s": (["0.25"], 0.25, 0.25),
    "redis_backoff_s": (["2"], 2.0, 2.0),
    "redis_max_backoff_s": (["30"], 30.0, 30.0),
    "write_through": ([], True, True),
    "cuda_graphs": ([], True, True),
    "speculative_config": (['{"method": "ngram"}'], '{"method": "ngram"}', '{"method": "ngram"}'),
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def field_of(config: EngineConfig, name: str):
    option = OPTIONS[name]
    holder = {EngineConfig: config, CacheConfig: config.cache, SchedulerConfig: config.scheduler}.get(option.owner)
    if holder is None:
        holder = next(t for t in config.tiers if type(t) is option.owner)
    return getattr(holder, option.field)


def readme_rows() -> dict[str, tuple[str, str]]:
    """option -> (flag, default) from the tables under "Engine options" and "Offload tiers"."""
    text = README.read_text()
    rows = {}
    for heading in ("### Engine options", "### Offload tiers"):
        section = text.split(heading, 1)[1].split("\n### ", 1)[0]
        for m in re.finditer(r"^\| `(\w+)` \| (`[^`]*`)? *\|([^|]*)\|", section, re.MULTILINE):
            rows[m[1]] = ((m[2] or "").strip("`"), m[3].strip().strip("`"))
    return rows


def test_every_option_has_a_sample():
    assert set(SAMPLES) == set(OPTIONS)


def test_every_flag_round_trips_to_its_field():
    argv = [arg for name, (values, _, _) in SAMPLES.items() for arg in (OPTIONS[name].flag, *values)]
    from_flags = engine_config(None, **engine_options(parse(argv)))
    from_keywords = engine_config(None, **{name: value for name, (_, value, _) in SAMPLES.items()})
    assert from_flags == from_keywords
    for name, (_, _, expected) in SAMPLES.items():
        assert field_of(from_flags, name) == expected, name
    assert [type(t) for t in from_flags.tiers] == [HostConfig, DiskConfig, RedisConfig]


def test_flags_not_given_leave_the_config_defaults():
    assert engine_config(None, **engine_options(parse([]))) == engine_config(None) == EngineConfig()


def test_every_option_is_in_the_readme_tables_with_its_flag_and_default():
    rows = readme_rows()
    assert set(rows) == set(OPTIONS), "README option tables and kvserve/options.py disagree"
    for name, option in OPTIONS.items():
        flag, default = rows[name]
        assert flag == option.flag, name
        if option.default is MISSING or option.default is None:
            continue
        if option.type is bool:
            assert default == ("on" if option.default else "off"), name
        elif option.type is str:
            assert default == option.default, name
        else:
            assert float(default) == option.from_field(option.default), name


def test_names_from_before_keep_working():
    config = engine_config(None, num_kv_blocks=9, scheduling_policy="priority", seed=3, kv_cache_memory_gb=2,
                           enable_prefix_caching=False)
    assert (config.cache.num_blocks, config.scheduler.policy, config.seed) == (9, "priority", 3)
    assert (config.cache.memory_bytes, config.cache.enable_prefix_caching) == (2 << 30, False)
    args = parse(["--num-kv-blocks", "9", "--engine-seed", "3", "--no-prefix-caching", "--kv-cache-gb", "2"])
    assert engine_config(None, **engine_options(args)) == engine_config(
        None, num_kv_blocks=9, seed=3, enable_prefix_caching=False, kv_cache_memory_gb=2)


def test_unknown_option_and_tier_option_without_its_tier():
    with pytest.raises(ValueError, match="unknown engine option 'num_blocks'; known options: attention_backend, blend_cost_model, blend_in_batch, blend_in_steps, blend_last_segments, blend_preamble, blend_query_layer, blend_select_layer, blend_selection, blend_sink_tokens"):
        engine_config(None, num_blocks=4)
    with pytest.raises(ValueError, match="disk_cache_gb given without disk_cache_dir"):
        engine_config(None, disk_cache_gb=4)
    with pytest.raises(ValueError, match="redis_ttl_s, redis_backoff_s given without redis_url"):
        engine_config(None, redis_ttl_s=4, redis_backoff_s=1)
    with pytest.raises(ValueError, match="disk_fsync given without disk_cache_dir"):
        engine_config(None, **engine_options(parse(["--no-disk-fsync"])))
    assert engine_config(None, host_cache_gb=0).tiers == ()
    with pytest.raises(ValueError, match="redis url must start with"):
        engine_config(None, redis_url="http://nope")


def test_tiers_are_in_lookup_order_whatever_the_keyword_order():
    tiers = engine_config(None, redis_url="redis://h:1/0", disk_cache_dir="/d", host_cache_gb=1).tiers
    assert tiers == (HostConfig(1 << 30), DiskConfig("/d"), RedisConfig("redis://h:1/0"))


def test_choices_come_from_the_registries():
    assert OPTIONS["scheduling_policy"].choices == tuple(POLICIES) == ("fcfs", "priority", "lpm")
    with pytest.raises(SystemExit):
        parse(["--scheduling-policy", "random"])
    assert "arkvale-bound" in OPTIONS["kv_policy"].help
    assert parse(["--kv-policy", "arkvale-w0.3"]).kv_policy == "arkvale-w0.3"   # parametric names pass


def test_subsets_for_bench_and_eval_commands():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, ("device", "dtype"))
    assert engine_options(parser.parse_args(["--dtype", "float32"])) == {"device": "auto", "dtype": "float32"}


def test_a_command_default_is_parsed_as_the_engine_flag_and_says_why_beside_the_engines():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, ("kv_cache_memory_gb", "kv_format", "disk_cache_dir"), defaults={
        "kv_cache_memory_gb": CommandDefault(0.25, "small"), "disk_cache_dir": CommandDefault(None, "a temporary one")})
    assert parser.parse_args([]).kv_cache_memory_gb == 0.25
    assert parser.parse_args(["--kv-cache-gb", "2"]).kv_cache_memory_gb == 2.0
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["kv_cache_memory_gb"] == "KV cache memory in GiB (default here: 0.25, small; the engine's: 1)"
    assert helps["disk_cache_dir"].endswith("(default here: a temporary one; the engine's: off)")
    assert helps["kv_format"] == OPTIONS["kv_format"].help     # no default of its own: the engine's help


def test_a_command_default_the_flag_could_not_parse_is_refused():
    cases = {"block_size": (CommandDefault(1.5, "why"), "--block-size takes int"),
             "dtype": (CommandDefault("fp16", "why"), "not one of auto, float32"),
             "enable_prefix_caching": (CommandDefault(False, "why"), "is a switch")}
    for name, (default, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            add_engine_args(argparse.ArgumentParser(), (name,), defaults={name: default})
    with pytest.raises(ValueError, match="options not added: kv_format"):
        add_engine_args(argparse.ArgumentParser(), ("device",), defaults={"kv_format": CommandDefault("int8", "why")})
    with pytest.raises(ValueError, match="needs its reason"):
        CommandDefault(0.5, "")
