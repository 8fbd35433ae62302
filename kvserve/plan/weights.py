"""Weights as the planner counts them: parameters per matrix, and bytes in one of the engine's
weight formats (``--weight-format``: kvserve/model/formats/spec.py), as the engine holds them
(kvserve/model/formats/build.py, packing.py).

A layer is four products, stacked as ``LlamaModel`` stacks them: Q/K/V (with Qwen2's biases), O,
gate/up and down; the model adds the LM head and the embedding (one matrix when tied). A product
of R stacked rows x C input columns is packed in T = ceil(R / 16) tiles of 16 rows; G is the group:

    native      R x C x 2 (fp16, bf16) or 4 (fp32): the compute dtype
    int8-ch     16T x C codes + 16T x 2 (one float16 scale per row)
    int8-gG     16T x C + 16T x C/G x 2 (int8: G = 32)
    int4-gG     16T x C/2 + 16T x C/G x 4 (a float16 scale and min per group)
    +outN       + N x R x 4 (float32 columns) + N x 4 (int32 channel ids), layer products only
    gguf        the file's blocks as the engine packs them (``PackedWeight.nbytes``); a product
                with a part no kernel reads (float in the file) is dequantized whole

Under int4 the LM head and the embedding are int8-g32. Norms are in the compute dtype; Q/K/V
biases too under native, float32 beside packed weights. An untied embedding is counted: it is
resident, though a decode step reads only its rows (``Decoder.weight_nbytes`` leaves it out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvserve.config import ModelConfig
from kvserve.model.formats.build import HEAD_GROUP
from kvserve.model.formats.packing import LANES, PackedWeight
from kvserve.model.formats.spec import WeightFormat, parse_weight_format
from kvserve.model.loaded import LoadedModel
from kvserve.plan.formats import compute_dtype
from kvserve.plan.models import ModelShape, resolve_model


class ProductShape(NamedTuple):
    """Matrices the engine multiplies as one product: stacked by rows, sharing an input."""

    name: str                               # the engine's name: self_attn.qkv, lm_head, embedding
    matrices: tuple[tuple[str, int], ...]   # (Hugging Face name, rows), in stacking order
    cols: int
    in_layers: bool                         # one per layer (model.layers.<i>.<name>), else one
    has_bias: bool = False
    is_head: bool = False                   # LM head or embedding: no outliers; int8-g32 under int4

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.matrices)

    def engine_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.name}" if self.in_layers else self.name

    def tensor_name(self, matrix: str, layer: int) -> str:
        """The loaded weight's name (Hugging Face's)."""
        return f"model.layers.{layer}.{matrix}.weight" if self.in_layers else f"{matrix}.weight"

    def label(self, matrix: str) -> str:
        """The matrix as the weights table names it."""
        return f"{matrix} (tied lm_head)" if self.name == "lm_head" and matrix != "lm_head" else matrix


class WeightRow(NamedTuple):
    """A line of the weights table: ``num_tensors`` tensors of one name, shape and format;
    parameters and bytes are of all of them (channel ids and padding hold bytes, no parameters)."""

    name: str
    shape: tuple[int, ...]
    num_tensors: int
    format: str
    num_params: int
    nbytes: int


@dataclass(frozen=True)
class WeightCount:
    """A model's weights in one format. ``weight_format``: the format counted (``auto``
    resolved); ``compute_format``: the dtype of native weights and norms."""

    model_name: str
    weight_format: str
    compute_format: str
    rows: tuple[WeightRow, ...]
    notes: tuple[str, ...] = ()

    @property
    def num_params(self) -> int:
        return sum(r.num_params for r in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.num_params

    def nbytes_of(self, name: str) -> int:
        """Bytes of the rows named ``name`` (every format and shape of it)."""
        return sum(r.nbytes for r in self.rows if r.name == name)


class _Rows:
    """Rows accumulated by (name, shape, format)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, tuple[int, ...], str], WeightRow] = {}

    def add(self, name: str, shape: tuple[int, ...], count: int, fmt: str, num_params: int, nbytes: int) -> None:
        short = name.removeprefix("model.").removeprefix("self_attn.").removeprefix("mlp.")
        key = (short, shape, fmt)
        old = self._rows.get(key, WeightRow(short, shape, 0, fmt, 0, 0))
        self._rows[key] = old._replace(num_tensors=old.num_tensors + count, num_params=old.num_params + num_params,
                                       nbytes=old.nbytes + nbytes)

    def rows(self) -> tuple[WeightRow, ...]:
        """Matrices first, then vectors, channel ids and padding."""
        return tuple(sorted(self._rows.values(), key=lambda r: len(r.shape) != 2))


def model_products(shape: ModelShape) -> tuple[ProductShape, ...]:
    """The engine's products of ``shape``, in the order it builds (and checks) them: the LM head,
    an untied embedding, then a layer's Q/K/V, O, gate/up and down. ValueError when the shape
    does not state the MLP width or the vocabulary."""
    ffn, vocab = shape.intermediate_size, shape.vocab_size
    if ffn is None or vocab is None:
        missing = [f for f in ("intermediate_size", "vocab_size") if getattr(shape, f) is None]
        raise ValueError(f"{shape.name} does not state its {' or '.join(missing)}, which the weights need: "
                         "pass its config.json, model directory or .gguf with --config")
    q, kv, hidden = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.hidden_size
    embed = ("model.embed_tokens", vocab)
    if shape.tie_word_embeddings:
        head: tuple[ProductShape, ...] = (ProductShape("lm_head", (embed,), hidden, False, is_head=True),)
    else:
        head = (ProductShape("lm_head", (("lm_head", vocab),), hidden, False, is_head=True),
                ProductShape("embedding", (embed,), hidden, False, is_head=True))
    return (*head,
            ProductShape("self_attn.qkv", (("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                                           ("self_attn.v_proj", kv)), hidden, True, shape.attention_bias),
            ProductShape("self_attn.o_proj", (("self_attn.o_proj", hidden),), q, True),
            ProductShape("mlp.gate_up", (("mlp.gate_proj", ffn), ("mlp.up_proj", ffn)), hidden, True),
            ProductShape("mlp.down_proj", (("mlp.down_proj", hidden),), ffn, True))


def packed_nbytes(rows: int, cols: int, bits: int, group: int) -> int:
    """A matrix quantized here (packing.py): rows padded to tiles of 16; per row ``cols`` codes
    of ``bits``, and per group a float16 scale (int8) or scale and min (int4)."""
    padded = -(-rows // LANES) * LANES
    return padded * (cols * bits // 8 + cols // group * (2 if bits == 8 else 4))


def count_weights(model: str | ModelShape | ModelConfig, weight_format: str = "native",
                  compute_format: str = "fp16", loaded: LoadedModel | None = None) -> WeightCount:
    """The weights of ``model`` in ``weight_format`` (any ``--weight-format``), native weights and
    norms in ``compute_format``. ``loaded``: the model's .gguf as loaded (``models.load_gguf``),
    which ``gguf`` counts and ``auto`` looks at (gguf when it has quantized blocks, else native).
    ValueError, saying why, for what the engine would refuse or what cannot be counted."""
    shape = resolve_model(model)
    fmt = parse_weight_format(weight_format)
    has_blocks = loaded is not None and any(isinstance(w, PackedWeight) for w in loaded.weights.values())
    notes: list[str] = []
    if fmt.base == "auto":
        fmt = WeightFormat("gguf") if has_blocks else WeightFormat("native")
        notes.append(f"weight format auto counted as {fmt.name}: gguf for a .gguf with quantized blocks "
                     "(given with --config), else native")
    rows = _Rows()
    if fmt.base == "gguf":
        if loaded is None:
            raise ValueError(f"weight format gguf counts a GGUF file's own quantized blocks, and {shape.name} "
                             "is given as a shape, not a file: pass the .gguf with --config "
                             "(kvserve plan --config model.gguf --weight-format gguf)")
        if not has_blocks:
            raise ValueError(f"weight format gguf keeps a GGUF file's quantized blocks, and {loaded.source} has "
                             "none (float weights): use native, int8 or int4")
        _count_file(loaded, shape, compute_format, rows)
    else:
        _count_formula(shape, fmt, compute_format, rows)
    _count_norms(shape, compute_format, rows)
    if shape.tie_word_embeddings is None:
        notes.append(f"{shape.name} does not say whether its LM head is tied to the embedding "
                     "(tie_word_embeddings): counted untied, as the engine loads such a config")
    return WeightCount(shape.name, fmt.name, compute_format, rows.rows(), tuple(notes))


def _product_format(fmt: WeightFormat, p: ProductShape) -> tuple[int, int, str]:
    """(bits per code, columns per group, the name the table gives it) of a product quantized here."""
    if p.is_head and fmt.base == "int4":
        return 8, HEAD_GROUP, f"int8-g{HEAD_GROUP}"
    name = fmt.base + ("" if fmt.group is None else f"-g{fmt.group}")
    name += f"+out{fmt.outliers}" if fmt.outliers and not p.is_head else ""
    return (8 if fmt.base == "int8" else 4), (fmt.group or p.cols), name


def _count_formula(shape: ModelShape, fmt: WeightFormat, compute_format: str, rows: _Rows) -> None:
    element = compute_dtype(compute_format).itemsize
    for p in model_products(shape):
        count = shape.num_layers if p.in_layers else 1
        if fmt.base == "native":
            for name, r in p.matrices:
                rows.add(p.label(name), (r, p.cols), count, compute_format, count * r * p.cols,
                         count * r * p.cols * element)
            _count_bias(p, count, compute_format, element, rows)
            continue
        bits, group, fmt_name = _product_format(fmt, p)
        if p.cols % group:      # the engine's refusal (build.py), at the first product it would quantize
            raise ValueError(f"weight format {fmt.name}: {p.engine_name(0)} has {p.cols} input columns, not a "
                             f"multiple of {group}; choose a group that divides every matrix's input width")
        outliers = 0 if p.is_head else fmt.outliers
        for name, r in p.matrices:
            nbytes = packed_nbytes(r, p.cols, bits, group) + outliers * r * 4
            rows.add(p.label(name), (r, p.cols), count, fmt_name, count * r * p.cols, count * nbytes)
        # the engine quantizes a stack as one matrix: its rows pad to 16 once, not per matrix
        padding = packed_nbytes(p.rows, p.cols, bits, group) - sum(
            packed_nbytes(r, p.cols, bits, group) for _, r in p.matrices)
        if padding:
            rows.add(f"{p.name} (stacked rows' padding)", (), count, fmt_name, 0, count * padding)
        if outliers:
            rows.add("outlier channel ids", (outliers,), count, "int32", 0, count * outliers * 4)
        _count_bias(p, count, "fp32", 4, rows)


def _count_file(loaded: LoadedModel, shape: ModelShape, compute_format: str, rows: _Rows) -> None:
    """``gguf``: each product as the engine makes it from the file's tensors: packed when every
    part is, else every part dequantized to the compute dtype."""
    element = compute_dtype(compute_format).itemsize
    file_shape = ModelShape.from_model_config(loaded.config, shape.name)
    for p in model_products(file_shape):
        for layer in range(file_shape.num_layers if p.in_layers else 1):
            parts = [(name, loaded.weights[p.tensor_name(name, layer)]) for name, _ in p.matrices]
            is_packed = all(isinstance(w, PackedWeight) for _, w in parts)
            for name, w in parts:
                r, c = w.shape
                if is_packed:
                    assert isinstance(w, PackedWeight)
                    rows.add(p.label(name), (r, c), 1, w.format_name, r * c, w.nbytes)
                else:
                    source = f" (from {w.format_name})" if isinstance(w, PackedWeight) else ""
                    rows.add(p.label(name), (r, c), 1, compute_format + source, r * c, r * c * element)
            _count_bias(p, 1, "fp32" if is_packed else compute_format, 4 if is_packed else element, rows)


def _count_bias(p: ProductShape, count: int, fmt: str, element: int, rows: _Rows) -> None:
    if p.has_bias:
        for name, r in p.matrices:
            rows.add(f"{name}.bias", (r,), count, fmt, count * r, count * r * element)


def _count_norms(shape: ModelShape, compute_format: str, rows: _Rows) -> None:
    element, hidden, layers = compute_dtype(compute_format).itemsize, shape.hidden_size, shape.num_layers
    for name, count in (("input_layernorm", layers), ("post_attention_layernorm", layers), ("model.norm", 1)):
        rows.add(name, (hidden,), count, compute_format, count * hidden, count * hidden * element)
