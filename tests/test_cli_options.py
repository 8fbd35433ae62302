"""Every command's engine flags come from kvserve/options.py: a flag named like an engine option
is that option's flag (it parses and is refused as the engine's does), a default of the
command's own says so in the help, and no flag of a command's own lands on an engine keyword
(``engine_options`` would hand it to the engine)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from kvserve.cli import build_parser, main
from kvserve.kv.codecs import parse_kv_format
from kvserve.options import OPTIONS

ENGINE_FLAGS = {o.flag: o for o in OPTIONS.values()}


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, argparse.Action]]:
    """(command, action) for every flag of every (sub)command of ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))
        elif action.option_strings:
            yield " ".join(path), action


def engine_flags() -> list[tuple[str, str, argparse.Action]]:
    return [(command, flag, action) for command, action in commands(build_parser())
            for flag in action.option_strings if flag in ENGINE_FLAGS]


def test_every_engine_flag_of_every_command_is_the_engine_option():
    found = engine_flags()
    assert len({command for command, _, _ in found}) >= 15     # generate, serve, plan, eval*, bench *
    for command, flag, action in found:
        option = ENGINE_FLAGS[flag]
        engine = option.argument()
        where = f"kvserve {command} {flag}"
        assert action.dest == option.name, where
        assert (action.type, action.choices, action.metavar) == (
            engine.get("type"), engine.get("choices"), engine.get("metavar")), where
        assert action.help.startswith(option.spec.help), where
        if action.default != engine["default"]:
            assert "(default here: " in action.help, f"{where}: a default of its own, not said in the help"


def test_no_flag_of_a_commands_own_lands_on_an_engine_keyword():
    for command, action in commands(build_parser()):
        if action.dest in OPTIONS:
            assert OPTIONS[action.dest].flag in action.option_strings, (command, action.option_strings)


def test_every_kv_format_flag_parses_alike_and_plan_refuses_as_the_engine_does(capsys):
    found = {command: action for command, flag, action in engine_flags() if flag == "--kv-format"}
    assert {"generate", "chat", "serve", "plan", "eval-budget", "bench tiers"} <= set(found)
    spec = "0-1=fp16;2-=k=kivi4,v=kivi2"
    assert {action.type(spec) for action in found.values()} == {spec}
    assert {action.default for action in found.values()} == {"auto"}     # the engine's, plan's too
    with pytest.raises(ValueError) as refused:
        parse_kv_format("int9", 30, torch.float16, head_dim=64)
    assert main(["plan", "--kv-format", "int9"]) == 2
    assert str(refused.value) in capsys.readouterr().err
