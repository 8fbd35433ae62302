"""``kvserve plan``: KV memory for a model, a context length, a batch and a format; with
``--weight-format``, the weights too, and with ``--device-gb`` the KV budget they leave."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.plan.formats import COMPUTE_FORMATS
from kvserve.plan.models import ModelShape, load_gguf, load_model_shape, resolve_model
from kvserve.plan.planner import GIB, KVLayout, PlanRequest, make_plan
from kvserve.plan.report import plan_to_dict, render_formats, render_models, render_plan
from kvserve.plan.weights import count_weights

if TYPE_CHECKING:
    from kvserve.model.loaded import LoadedModel

_EXAMPLES = """examples:
  kvserve plan --model llama-3-70b --context 2048 --batch 100 --kv-format fp16 --memory-gb 80
  kvserve plan --model llama-3-8b --context 1000 --shared-prefix-tokens 1000 --users 1000
  kvserve plan --model qwen2-7b --kv-format kivi4 --host-gb 64 --disk-gb 500
  kvserve plan --config path/to/config.json --key-format int8 --value-format int4
  kvserve plan --model llama-3-70b --weight-format int4 --device-gb 80 --context 8192
  kvserve plan --config model.gguf --weight-format gguf --device-gb 24
  kvserve plan --list-models"""

_TIERS = ("host", "disk", "redis")
_DEFAULT_MODEL = "SmolLM2-135M"


def _gib_to_bytes(gib: float | None) -> int | None:
    return None if gib is None else round(gib * GIB)


def _load_model(args: argparse.Namespace) -> tuple[ModelShape, LoadedModel | None]:
    """The model's shape and, for a .gguf file, its loaded weights (what ``gguf`` counts)."""
    source = args.config or args.model
    if source is not None and Path(source).suffix == ".gguf" and Path(source).expanduser().is_file():
        return load_gguf(source)
    return (load_model_shape(args.config) if args.config else resolve_model(args.model or _DEFAULT_MODEL)), None


def run_plan(args: argparse.Namespace) -> int:
    if args.list_models:
        sys.stdout.write(render_models())
        return 0
    model, loaded = _load_model(args)
    if args.list_formats:
        sys.stdout.write(render_formats(model.head_dim))
        return 0
    context = args.context if args.context is not None else model.max_context
    if context is None:
        raise ValueError(f"{model.name} does not state its context length; pass --context")
    layout = KVLayout.build(model, args.kv_format, key_format=args.key_format, value_format=args.value_format,
                            block_size=args.block_size, compute_format=args.compute_dtype)
    tiers = tuple((name, nbytes) for name in _TIERS
                  if (nbytes := _gib_to_bytes(getattr(args, f"{name}_gb"))) is not None)
    request = PlanRequest(context_tokens=context, batch_size=args.batch, memory_bytes=_gib_to_bytes(args.memory_gb),
                          prefix_tokens=args.shared_prefix_tokens, num_users=args.users, tier_nbytes=tiers,
                          device_bytes=_gib_to_bytes(args.device_gb))
    # a device holds weights: in the engine's default format unless one is named
    weight_format = args.weight_format or ("auto" if args.device_gb is not None else None)
    weights = None if weight_format is None else count_weights(model, weight_format, args.compute_dtype, loaded)
    plan = make_plan(layout, request, weights)
    if args.json is None:
        sys.stdout.write(render_plan(plan))
        return 0
    text = json.dumps(plan_to_dict(plan), indent=2) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    else:
        Path(args.json).write_text(text)
        sys.stdout.write(render_plan(plan))
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``kvserve plan``'s parser, less the engine's own flags (--kv-format, --block-size,
    --weight-format): kvserve/cli.py adds those from kvserve/options.py, a floor above plan/."""
    p = sub.add_parser("plan", help="KV memory planner: bytes per token/sequence/batch, what fits, "
                                    "prefix sharing, offload tiers",
                       description=__doc__, epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help=f"a built-in model name (see --list-models) or a path (default {_DEFAULT_MODEL})")
    src.add_argument("--config", default=None,
                     help="a Hugging Face config.json, a model directory, or a .gguf file")
    src.add_argument("--list-models", action="store_true", help="print the built-in models and exit")
    p.add_argument("--list-formats", action="store_true",
                   help="print the bytes of every KV format at the model's head dim and exit")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's max context)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences of --context tokens (default 1)")
    p.add_argument("--key-format", default=None, help="override the K half's format (a codec, e.g. int8)")
    p.add_argument("--value-format", default=None, help="override the V half's format (a codec, e.g. int4)")
    p.add_argument("--compute-dtype", default="fp16", choices=list(COMPUTE_FORMATS),
                   help="the engine's compute dtype: of native KV (what --kv-format's default, auto, stores at a 16-bit "
                        "compute dtype; over fp32 it stores fp16, as the engine's), of "
                        "KIVI's residual (the open block of each sequence) and, with --weight-format, of native "
                        "weights and the norms (default fp16; an engine on the CPU computes in fp32)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--memory-gb", type=float, default=None, help="device KV budget in GiB")
    budget.add_argument("--device-gb", type=float, default=None,
                        help="device memory in GiB for the weights and the KV cache: the KV budget is what the "
                             "weights (--weight-format) leave")
    p.add_argument("--shared-prefix-tokens", type=int, default=None,
                   help="tokens every user's sequence starts with (a system prompt); needs --users")
    p.add_argument("--users", type=int, default=None, help="sequences sharing the prefix")
    for tier in _TIERS:
        p.add_argument(f"--{tier}-gb", type=float, default=None, help=f"{tier} tier size in GiB")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the plan as JSON to PATH ('-': print JSON instead of the table)")
    p.set_defaults(run=run_plan)
    return p
