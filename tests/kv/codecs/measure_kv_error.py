"""Quality cost of each KV format on real text (the table in docs/kv_formats.md).

    python tests/kv/codecs/measure_kv_error.py [--tokens 1024] [SPEC ...]    e.g. 'k=int8,v=int4' kivi2+had

Runs the default model (SmolLM2-135M, float32) densely over the first ``--tokens``
tokens of Botchan and reports, per format:

* K / V error: ||decode(encode(x)) - x|| / ||x|| over all layers' full blocks;
* attention error: the same for each layer's attention output when the layer's
  keys and values (all of them, computed exactly) are replaced by their round trip;
* perplexity and next-token agreement with every layer's K and V replaced by their
  round trip as the forward pass goes (errors compound through the layers). This
  quantizes every block, including the one an engine keeps in full precision, so it
  is slightly pessimistic.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.kv.codecs import LayerFormat, fp8_supported, parse_kv_format
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_model

BOTCHAN = Path(__file__).resolve().parents[3] / "kvserve" / "data" / "botchan.txt"   # shipped in the package
BASE = ["fp16", "bf16", "fp8", "int8", "int4", "kivi4", "kivi2", "int2"]
EXTRA = ["k=int8,v=int4", "k=kivi4,v=kivi2", "k=kivi2+out4,v=kivi2", "k=kivi2+had+out4,v=kivi2+had"]


def default_formats() -> list[str]:
    base = [f for f in BASE if f != "fp8" or fp8_supported()]
    quantized = [f for f in base if f not in ("fp16", "bf16")]
    return base[:2] + [f + opt for f in quantized for opt in ("", "+out4", "+had", "+had+out4")] + EXTRA


def round_trip(layer: LayerFormat | None, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [T, H, D] (T a multiple of 16) through the layer's codecs, block by block."""
    if layer is None:
        return k, v
    out = []
    for codec, x in ((layer.key, k), (layer.value, v)):
        blocks = x.reshape(-1, 16, *x.shape[1:])
        out.append(codec.decode(codec.encode(blocks), x.dtype).reshape(x.shape))
    return out[0], out[1]


def attention(model: LlamaModel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=model.scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@torch.inference_mode()
def forward(model: LlamaModel, ids: torch.Tensor, layers: tuple[LayerFormat, ...] | None,
            capture: list[tuple[torch.Tensor, ...]] | None = None) -> torch.Tensor:
    """Logits [T, vocab] of a dense causal forward (LlamaModel.forward without the paged
    cache), each layer attending to the round trip of its keys and values."""
    angles = model.angles(torch.arange(ids.shape[0]))
    h = model.embed(ids)
    for i in range(model.config.num_layers):
        q, k, v = model.layer_qkv(i, h, angles)
        if capture is not None:
            capture.append((q, k, v))
        k, v = round_trip(None if layers is None else layers[i], k, v)
        h = model.layer_output(i, h, attention(model, q, k, v))
    return model.compute_logits(model.final_norm_of(h))


def rel(err_sq: float, ref_sq: float) -> float:
    return math.sqrt(err_sq / ref_sq)


def measure(model: LlamaModel, ids: torch.Tensor, spec: str, base_logits: torch.Tensor,
            captured: list[tuple[torch.Tensor, ...]]) -> str:
    cfg = model.config
    fmt = parse_kv_format(spec, cfg.num_layers, torch.float32, head_dim=cfg.head_dim)
    sums = dict.fromkeys(("k", "k_ref", "v", "v_ref", "o", "o_ref"), 0.0)
    with torch.inference_mode():
        for layer, (q, k, v) in zip(fmt.layers, captured, strict=True):
            k2, v2 = round_trip(layer, k, v)
            o, o2 = attention(model, q, k, v), attention(model, q, k2, v2)
            for name, ref, got in (("k", k, k2), ("v", v, v2), ("o", o, o2)):
                sums[name] += (got - ref).pow(2).sum().item()
                sums[name + "_ref"] += ref.pow(2).sum().item()
    logits = forward(model, ids, fmt.layers)
    nll = F.cross_entropy(logits[:-1], ids[1:]).item()
    agree = (logits[:-1].argmax(-1) == base_logits[:-1].argmax(-1)).float().mean().item()
    nbytes = fmt.bytes_per_token(16, cfg.num_kv_heads, cfg.head_dim)
    return (f"| `{fmt.spec}` | {nbytes:,.1f} | {rel(sums['k'], sums['k_ref']):.4f} | "
            f"{rel(sums['v'], sums['v_ref']):.4f} | {rel(sums['o'], sums['o_ref']):.4f} | "
            f"{math.exp(nll):.3f} | {100 * agree:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens (rounded down to blocks of 16)")
    parser.add_argument("specs", nargs="*", help="KV format specs (default: every format with and without options)")
    args = parser.parse_args()
    formats = args.specs or default_formats()
    torch.manual_seed(0)
    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32)
    ids = torch.tensor(loaded.tokenizer.encode(BOTCHAN.read_text(encoding="utf-8"))[:args.tokens // 16 * 16])
    captured: list[tuple[torch.Tensor, ...]] = []
    base = forward(model, ids, None, captured)
    base_ppl = math.exp(F.cross_entropy(base[:-1], ids[1:]).item())
    print(f"{len(ids)} tokens of Botchan, SmolLM2-135M float32; perplexity without KV compression {base_ppl:.3f}\n")
    print("| format | bytes/token | K rel. err | V rel. err | attn-out rel. err | perplexity | top-1 agree |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for spec in formats:
        start = time.perf_counter()
        row = measure(model, ids, spec, base, captured)
        print(row, flush=True)
        print(f"  ({time.perf_counter() - start:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
