"""Engine options: the one place that turns config fields into ``LLM(...)`` keywords and CLI flags.

Every option is a field of a config class carrying an ``Option`` in its metadata
(kvserve/config.py). From those this module builds:

    engine_config(model, **options)   flat keywords -> EngineConfig   (LLM(**options) uses it)
    add_engine_args(parser)           the flags of every command that builds an engine (or plans one)
    engine_options(args)              parsed flags -> flat keywords

A command that takes an engine option takes it through ``add_engine_args``, so that the flag
parses the same everywhere; where the command needs a default of its own it says so with a
``CommandDefault``, which the flag's help shows beside the engine's.

    keyword               flag                    field
    kv_cache_memory_gb    --kv-cache-gb           CacheConfig.memory_bytes     (GiB -> bytes)
    scheduling_policy     --scheduling-policy     SchedulerConfig.policy       (choices: the policy registry)
    disk_cache_dir        --disk-cache            DiskConfig.path              (turns the disk tier on)

The tier options build ``EngineConfig.tiers`` in lookup order (host, disk, redis); a
tier is on when its first field's option is given (a size of 0 leaves it off).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from types import MappingProxyType
from typing import Any, NamedTuple, get_args, get_type_hints

from kvserve.attention.backends import ATTENTION_BACKENDS, AUTO
from kvserve.config import TIER_CONFIGS, CacheConfig, EngineConfig, Option, SchedulerConfig, TierConfig
from kvserve.kv.budget.policies import POLICIES as BUDGET_POLICIES
from kvserve.kv.budget.policies import TUNED_ARKVALE
from kvserve.scheduler.policies import POLICIES as SCHEDULING_POLICIES

_UNITS: Mapping[str, int] = MappingProxyType({"GiB": 1 << 30})
_GROUPS: Mapping[str, str] = MappingProxyType({   # Option.group -> the title of its CLI help section
    "engine": "engine",
    "offload": "offload tiers (docs/offload.md): evicted KV blocks go to every tier given; "
               "prefix hits are looked up in host, then disk, then Redis",
})


class Registry(NamedTuple):
    """The names an option takes. ``is_closed``: the flag accepts only those (budget
    policies also take parametric names such as arkvale-w0.25-m1: their help lists them)."""

    names: Callable[[], Sequence[str]]
    is_closed: bool


_REGISTRIES: Mapping[str, Registry] = MappingProxyType({
    "scheduling policies": Registry(lambda: tuple(SCHEDULING_POLICIES), is_closed=True),
    "kv budget policies": Registry(lambda: (*BUDGET_POLICIES, f"{TUNED_ARKVALE}-w<0..1>-m<margin>"), is_closed=False),
    "attention backends": Registry(lambda: (*ATTENTION_BACKENDS, AUTO), is_closed=True),
})


@dataclass(frozen=True)
class CommandDefault:
    """A command's own default for an engine flag, and why it is not the engine's: the flag's
    help shows both. ``value`` is in the flag's units (GiB for a size); None: the flag not
    given, the command does what ``reason`` says (``CommandDefault(None, "a temporary
    directory")``)."""

    value: Any
    reason: str

    def __post_init__(self) -> None:
        if not self.reason:
            raise ValueError("a command's own default for an engine flag needs its reason, for the help")


@dataclass(frozen=True)
class EngineOption:
    """One option: its keyword ``name``, its ``flag``, and the config field it sets."""

    name: str
    flag: str
    owner: type          # the config class holding the field
    field: str
    type: type           # of the value users give (float for a size in GiB)
    default: Any         # the field's default (MISSING for a tier's first field), in field units
    spec: Option

    @property
    def is_tier(self) -> bool:
        return self.owner in TIER_CONFIGS

    def to_field(self, value: Any) -> Any:
        if self.spec.unit is not None:
            return int(float(value) * _UNITS[self.spec.unit])
        return value

    def from_field(self, value: Any) -> Any:
        return value / _UNITS[self.spec.unit] if self.spec.unit is not None else value

    @property
    def registry(self) -> Registry | None:
        return None if self.spec.registry is None else _REGISTRIES[self.spec.registry]

    @property
    def choices(self) -> tuple[str, ...]:
        return self.spec.choices if self.registry is None else tuple(self.registry.names())

    @property
    def is_closed(self) -> bool:
        """Whether a flag accepts only ``choices`` (when there are any)."""
        return self.registry is None or self.registry.is_closed

    @property
    def default_text(self) -> str | None:
        if self.default is MISSING or self.default is None or self.default == "":
            return self.spec.default_text
        if self.type is bool:
            return None     # the flag flips the default; its help says to what
        return f"{self.from_field(self.default):g}" if self.spec.unit else str(self.default)

    @property
    def help(self) -> str:
        return self._text if self.default_text is None else f"{self._text} (default: {self.default_text})"

    def help_with(self, default: CommandDefault) -> str:
        """The help of a command's flag with its own ``default``, the engine's beside it."""
        value = None if default.value is None else f"{default.value:g}" if self.spec.unit else str(default.value)
        here = default.reason if value is None else f"{value}, {default.reason}"
        engine = "" if self.default_text is None else f"; the engine's: {self.default_text}"
        return f"{self._text} (default here: {here}{engine})"

    @property
    def _text(self) -> str:
        return self.spec.help if self.is_closed else f"{self.spec.help}: {', '.join(self.choices)}"

    def argument(self, own: CommandDefault | None = None) -> dict[str, Any]:
        """The ``add_argument`` keywords of the flag; with ``own``, a command's default instead of
        the engine's (ValueError for one the flag could not have parsed)."""
        if own is None:
            default = None if self.is_tier or self.default is MISSING else self.from_field(self.default)
            kw: dict[str, Any] = {"dest": self.name, "help": self.help, "default": default}
        else:
            self._check(own.value)
            kw = {"dest": self.name, "help": self.help_with(own), "default": own.value}
        if self.type is bool:
            return kw | {"action": "store_const", "const": not self.default}
        kw["type"] = self.type
        if self.choices and self.is_closed:
            kw["choices"] = self.choices       # argparse shows them
        else:
            kw["metavar"] = self.spec.metavar or self.flag.removeprefix("--").replace("-", "_").upper()
        return kw

    def _check(self, value: Any) -> None:
        if self.type is bool:
            raise ValueError(f"{self.flag} is a switch: its default is the engine's")
        if value is None:
            return
        if not isinstance(value, self.type) and not (self.type is float and type(value) is int):
            raise ValueError(f"{self.flag} takes {self.type.__name__}, and the command default is {value!r}")
        if self.choices and self.is_closed and value not in self.choices:
            raise ValueError(f"{self.flag}: the command default {value!r} is not one of {', '.join(self.choices)}")


def _options_of(owner: type) -> list[EngineOption]:
    hints = get_type_hints(owner)
    out = []
    for f in fields(owner):
        spec = f.metadata.get("option")
        if spec is None:
            continue
        name = spec.name or f.name
        value_type = next(t for t in get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        out.append(EngineOption(name=name, flag=spec.flag or "--" + name.replace("_", "-"), owner=owner,
                                field=f.name, type=float if spec.unit else value_type, default=f.default,
                                spec=spec))
    return out


OPTIONS: Mapping[str, EngineOption] = MappingProxyType({
    o.name: o for owner in (EngineConfig, CacheConfig, SchedulerConfig, *TIER_CONFIGS) for o in _options_of(owner)})


def engine_config(model: str | None = None, **options: Any) -> EngineConfig:
    """An EngineConfig from flat keyword options (``OPTIONS``; README "Engine options").

    None means "not given": the field keeps its default. ValueError for an unknown name,
    or for a tier's option without the option that turns the tier on.
    """
    values: dict[type, dict[str, Any]] = {}
    for name, value in options.items():
        option = OPTIONS.get(name)
        if option is None:
            raise ValueError(f"unknown engine option {name!r}; known options: {', '.join(sorted(OPTIONS))}")
        if value is not None:
            values.setdefault(option.owner, {})[option.field] = option.to_field(value)
    return EngineConfig(model=model, cache=CacheConfig(**values.get(CacheConfig, {})),
                        scheduler=SchedulerConfig(**values.get(SchedulerConfig, {})),
                        tiers=_tiers(values), **values.get(EngineConfig, {}))


def _tiers(values: dict[type, dict[str, Any]]) -> tuple[TierConfig, ...]:
    tiers = []
    for cls in TIER_CONFIGS:
        given = values.get(cls, {})
        switch = fields(cls)[0].name
        if given.get(switch, 0) != 0:       # host_cache_gb=0 leaves the host tier off, as no option does
            tiers.append(cls(**given))
        elif set(given) - {switch}:
            names = ", ".join(o.name for o in OPTIONS.values() if o.owner is cls and o.field in given)
            on = next(o.name for o in OPTIONS.values() if o.owner is cls and o.field == switch)
            raise ValueError(f"{names} given without {on}, which turns that tier on")
    return tuple(tiers)


def add_engine_args(parser: argparse.ArgumentParser, names: Iterable[str] | None = None,
                    defaults: Mapping[str, CommandDefault] | None = None) -> None:
    """The flags of ``names`` (every option by default, with ``--model``), in their help groups.

    A flag not given parses to its field's default, or to None for a tier's option (not
    given: the tier stays off), or to the command's own ``defaults[name]``. ValueError for
    a default of an option not among ``names``, or one its flag could not have parsed."""
    chosen = list(OPTIONS) if names is None else list(names)
    defaults = defaults or {}
    unknown = set(defaults) - set(chosen)
    if unknown:
        raise ValueError(f"command defaults for options not added: {', '.join(sorted(unknown))}")
    groups: dict[str, argparse._ArgumentGroup] = {}

    def group(key: str) -> argparse._ArgumentGroup:
        if key not in groups:
            groups[key] = parser.add_argument_group(_GROUPS[key])
        return groups[key]

    if names is None:
        group("engine").add_argument(
            "--model", default=None,
            help="a .gguf file, a Hugging Face model directory, or the default SmolLM2-135M-Instruct")
    for name in chosen:
        o = OPTIONS[name]
        group(o.spec.group).add_argument(o.flag, **o.argument(defaults.get(name)))


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword options of the engine flags in ``args`` (each flag's dest is its keyword)."""
    return {o.name: getattr(args, o.name) for o in OPTIONS.values() if getattr(args, o.name, None) is not None}
