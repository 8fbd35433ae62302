"""Frozen configuration objects.

Every config is validated in ``__post_init__``; derived values are properties.
Values discovered at run time (number of KV blocks, eos ids) live in the objects
that discover them and are passed explicitly.

The fields users set (``LLM(...)`` keywords, CLI flags) carry an ``Option`` in their
metadata; kvserve/options.py builds both from it. Names that need a registry (the
scheduling policy, the KV budget policy) are checked where the registry is used, when
the engine builds the part or admits the request.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Option:
    """How a config field is offered to users, as an ``LLM(...)`` keyword and a CLI flag.

    ``name``: the keyword, when it is not the field's name. ``flag``: the CLI flag, when it
    is not ``--`` and the name with dashes; a bool field's flag sets the opposite of its
    default (``--no-prefix-caching``). ``unit``: ``"GiB"`` for a byte count given in GiB.
    ``choices``: the accepted values; ``registry``: the registry whose names the option
    takes (resolved by options.py, the layer that may import registries).
    ``default_text``: how to show a default of None. ``group``: the CLI help section.
    """

    help: str
    name: str | None = None
    flag: str | None = None
    unit: str | None = None
    choices: tuple[str, ...] = ()
    registry: str | None = None
    default_text: str | None = None
    metavar: str | None = None
    group: str = "engine"


def opt(help: str, **kw: Any) -> dict[str, Option]:
    """Field metadata for an option: ``field(default=..., metadata=opt("...", ...))``."""
    return {"option": Option(help, **kw)}


#: how blending picks the reused tokens it recomputes (kvserve/blend/blending.py): "deviation"
#: (CacheBlend: at ``blend_select_layer``, whose fresh KV differs most from the cached; recomputed
#: from that layer on), "query" (the text after the last segment, the question, computed first
#: over the cached KV; the tokens its queries attend to most, over every layer, recomputed in
#: every layer), "query-segments" (the same first pass, read at one layer; windows around the
#: question's peak in the segments it attends to most, best segment first, recomputed)
BLEND_SELECTIONS = ("deviation", "narrowing", "query", "query-segments")
QUERY_SELECTIONS = ("query", "query-segments")     # those that compute the question first, to choose
#: the engine option also takes "auto": query-segments where the model's query layer is known,
#: else deviation (kvserve/blend/calibrated.py)
BLEND_SELECTION_CHOICES = ("auto", *BLEND_SELECTIONS)


class BlendOptionError(ValueError):
    """A bad blend selection option; ``option`` names it (the server's 400 ``param``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option

    def __reduce__(self) -> tuple[type[BlendOptionError], tuple[str, str]]:     # crosses processes (Ray) whole
        return type(self), (self.option, str(self))


def check_blend_selection(selection: str, sink_tokens: int, last_segments: int = 0,
                          choices: tuple[str, ...] = BLEND_SELECTIONS) -> None:
    if selection not in choices:
        raise BlendOptionError("blend_selection",
                               f"unknown blend selection {selection!r}; choose one of {', '.join(choices)}")
    for name, value in (("blend_sink_tokens", sink_tokens), ("blend_last_segments", last_segments)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BlendOptionError(name, f"{name} must be an integer >= 0, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling of RoPE ("llama3" in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer's attention is: its kind (full, or sliding: each query sees the
    ``sliding_window`` positions up to and including its own) and its RoPE (base and scaling).
    Attention, the batch and the KV manager read it; ``ModelConfig.layer_specs`` gives one per layer."""

    sliding_window: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (None: full attention), got {self.sliding_window}")
        _positive("rope_theta", self.rope_theta)

    @property
    def attention_kind(self) -> str:
        """``full`` or ``sliding``: the layer groups of a model are its layers of one kind and window."""
        return "full" if self.sliding_window is None else "sliding"


#: the MLP activations a family may gate with: SiLU (SwiGLU: Llama, Qwen2, Mistral) or GELU with
#: the tanh approximation (GeGLU: Gemma)
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of one of the registered families (kvserve/model/families.py).

    The fields after ``rope_scaling`` are what families other than Llama's differ in (their
    defaults are Llama's): ``layers`` (one ``LayerSpec`` per layer where layers differ: Gemma 3's
    sliding and full layers with their two RoPE bases; empty: every layer full attention with
    ``rope_theta`` / ``rope_scaling``), ``activation`` (of the gated MLP), ``qk_norm`` (RMSNorm of
    each head's query and key before RoPE), ``sandwich_norms`` (norms after attention and after
    the MLP as well as before each), ``embedding_multiplier`` (the embedding's rows scaled by it),
    ``query_pre_attn_scalar`` (attention scores scaled by its -1/2 power instead of head_dim's) and
    ``final_logit_softcapping`` (logits squashed to +-cap by cap * tanh(logits / cap))."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    rope_scaling: RopeScaling | None = None
    layers: tuple[LayerSpec, ...] = ()
    activation: str = "silu"
    qk_norm: bool = False
    sandwich_norms: bool = False
    embedding_multiplier: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.layers and len(self.layers) != self.num_layers:
            raise ValueError(f"ModelConfig.layers has {len(self.layers)} specs for {self.num_layers} layers")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        for name in ("embedding_multiplier", "query_pre_attn_scalar", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                _positive(f"ModelConfig.{name}", getattr(self, name))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.kv_size * element_size

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """One spec per layer (``layers``, or every layer full with the model's RoPE)."""
        if self.layers:
            return self.layers
        return (LayerSpec(None, self.rope_theta, self.rope_scaling),) * self.num_layers

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention)."""
        return tuple(spec.sliding_window for spec in self.layer_specs)

    @property
    def has_sliding_layers(self) -> bool:
        return any(w is not None for w in self.sliding_windows)

    @property
    def query_scale(self) -> float:
        """What attention scores are multiplied by: 1 / sqrt(query_pre_attn_scalar or head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (the weights cache keeps configs so); ``from_dict`` reads them back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        def scaling(s: dict[str, Any] | None) -> RopeScaling | None:
            return RopeScaling(**s) if s else None

        layers = tuple(LayerSpec(**(spec | {"rope_scaling": scaling(spec.get("rope_scaling"))}))
                       for spec in d.get("layers", ()))
        return cls(**(d | {"eos_token_ids": tuple(d["eos_token_ids"]), "rope_scaling": scaling(d.get("rope_scaling")),
                           "layers": layers}))


@dataclass(frozen=True)
class CacheConfig:
    """The device KV cache.

    Its size is either ``num_blocks`` or ``memory_bytes`` (turned into blocks once
    the model's bytes per block are known); ``num_blocks`` wins when both are set.
    """

    block_size: int = field(default=16, metadata=opt("tokens per KV block"))
    memory_bytes: int = field(default=1 << 30, metadata=opt(
        "KV cache memory in GiB", name="kv_cache_memory_gb", flag="--kv-cache-gb", unit="GiB"))
    num_blocks: int | None = field(default=None, metadata=opt(
        "KV cache size in blocks (overrides --kv-cache-gb)", name="num_kv_blocks"))
    enable_prefix_caching: bool = field(default=True, metadata=opt(
        "turn automatic prefix caching off", flag="--no-prefix-caching"))
    cache_salt: str = field(default="", metadata=opt(
        "mixed into every block's key: engines with different salts share no cached blocks", default_text="none"))
    key_secret_file: str | None = field(default=None, metadata=opt(
        "file of the secret block keys are keyed with (HMAC), created on first use: no one without it can "
        "compute a block's key offline; engines that share cached blocks (replicas, restarts, the disk and "
        "Redis tiers) share it", default_text="$KVSERVE_CACHE_DIR/block-key-secret", metavar="FILE"))
    kv_format: str = field(default="auto", metadata=opt(
        "KV storage: auto (16 bits: fp16 over float32 compute, as on CPU; else native), native (the compute "
        "dtype), fp16, bf16, fp8, int8, int4, kivi2, kivi4, with +outN/+had and per-layer or "
        "per-half specs, e.g. '0-1=fp16;2-=kivi2', or precision by saliency, e.g. "
        "'zip:hi=int8+had,lo=kivi2+had,salient=0.2' (docs/kv_formats.md)"))
    kv_budget: int | None = field(default=None, metadata=opt(
        "tokens of KV cache kept per layer for each request (docs/budgets.md)", default_text="no budget"))
    kv_policy: str = field(default="streaming", metadata=opt(
        "what a budgeted request keeps", registry="kv budget policies"))
    budget_host_bytes: int = field(default=4 << 30, metadata=opt(
        "host memory in GiB for the blocks arkvale moves off the device, least recently stashed going first "
        "when full (docs/budgets.md); under a zip: KV format, for the finer copies a prompt's chunks drop "
        "until the whole prompt ranks them again (docs/kv_formats.md)",
        name="kv_budget_host_gb", flag="--kv-budget-host-gb", unit="GiB"))

    blend_cost_model: bool = field(default=True, metadata=opt(
        "blend a segmented prompt only when loading plus the partial recompute is estimated to beat a full "
        "prefill; off: blend every one (quality studies; docs/blend.md)", flag="--blend-always"))
    blend_select_layer: int = field(default=1, metadata=opt(
        "the layer where blending compares fresh and cached KV to pick the tokens it recomputes; layers "
        "below it run for every token (docs/blend.md)"))
    blend_selection: str = field(default="deviation", metadata=opt(
        "how blending picks the reused tokens it recomputes: auto (query-segments where the model's "
        "blend_query_layer is known, given or calibrated: SmolLM2-135M's 18; else deviation), deviation "
        "(CacheBlend: fresh vs cached KV at "
        "blend_select_layer), narrowing (the same, narrowed layer by layer: 2f, 1.5f, then f), query (the text after the last segment computed first; the tokens its queries "
        "attend to most, recomputed in every layer), query-segments (the same first pass; windows around the "
        "question's peak, best segment first) (docs/blend.md)",
        choices=BLEND_SELECTION_CHOICES))
    blend_sink_tokens: int = field(default=0, metadata=opt(
        "each reused segment's first tokens always recomputed (its spurious attention sink; docs/blend.md)"))
    blend_last_segments: int = field(default=0, metadata=opt(
        "the last segments of a prompt (nearest the question after them) recomputed whole, whatever the "
        "selection; blend_fraction is then taken of the others (docs/blend.md)"))
    blend_query_layer: int | None = field(default=None, metadata=opt(
        "the layer whose attention the query selections read (calibrated per model: 18 for SmolLM2-135M; "
        "docs/blend.md)", default_text="every layer, summed (auto: the model's calibrated layer)"))
    blend_preamble: str | None = field(default=None, metadata=opt(
        "text every segment is computed after before it is stored (a system prompt, say), so a document's "
        "stored KV has seen the start of a prompt instead of starting one; part of the segments' keys "
        "(docs/blend.md)", default_text="none"))
    blend_in_steps: bool = field(default=True, metadata=opt(
        "run a blend a few layers at a time, at most a step's token budget (max_num_batched_tokens) of work "
        "between two steps, so decoding requests keep stepping (docs/blend.md); with chunked prefill only",
        flag="--no-blend-in-steps"))
    blend_in_batch: bool = field(default=True, metadata=opt(
        "compute a blend's recomputed rows as chunks of the engine's steps, through its attention backend "
        "and KV format, beside the other requests (only the choice of rows runs outside the batch); off: "
        "the whole blend outside the batch, on dense tensors (docs/blend.md)", flag="--no-blend-in-batch"))

    window_kv: bool = field(default=True, metadata=opt(
        "keep every layer's blocks whole on models with sliding-window layers (as an engine without layer groups "
        "does; for comparisons): by default those layers hold only the blocks their window reaches "
        "(docs/design.md, Layer groups)", flag="--no-window-kv"))
    max_pinned_fraction: float = field(default=0.5, metadata=opt(
        "most of the device KV blocks that pinned prefixes may cover; 0 turns pinning off (docs/server.md)"))
    max_pin_ttl_s: float = field(default=3600.0, metadata=opt("longest retention a pin may ask for, in seconds"))

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}")
        _positive("max_pin_ttl_s", self.max_pin_ttl_s)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.memory_bytes <= 0:
            raise ValueError(f"KV cache memory must be positive, got {self.memory_bytes} bytes")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.blend_select_layer < 1:
            raise ValueError(f"blend_select_layer must be >= 1, got {self.blend_select_layer}")
        check_blend_selection(self.blend_selection, self.blend_sink_tokens, self.blend_last_segments,
                              BLEND_SELECTION_CHOICES)
        if self.blend_preamble is not None and not self.blend_preamble:
            raise ValueError("blend_preamble must be a non-empty text (None: no preamble)")
        if self.blend_query_layer is not None and self.blend_query_layer < 0:
            raise ValueError(f"blend_query_layer must be >= 0, got {self.blend_query_layer}")
        if self.budget_host_bytes < 0:
            raise ValueError(f"budget host memory must be >= 0 bytes, got {self.budget_host_bytes}")

    def resolve_num_blocks(self, bytes_per_block: int, reserved_bytes: int = 0) -> int:
        """Blocks that fit in ``memory_bytes`` after ``reserved_bytes`` (e.g. residual rows)."""
        if self.num_blocks is not None:
            return self.num_blocks
        num = (self.memory_bytes - reserved_bytes) // bytes_per_block
        if num < 1:
            raise ValueError(
                f"KV cache memory of {self.memory_bytes} bytes holds no block of {bytes_per_block} bytes "
                f"(after {reserved_bytes} bytes reserved for full-precision residual rows)")
        return num


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits and order. ``policy`` names a scheduling policy
    (kvserve/scheduler/policies.py: fcfs, priority, lpm)."""

    max_num_batched_tokens: int = field(default=512, metadata=opt("token budget per step"))
    max_num_seqs: int = field(default=64, metadata=opt("most requests running at once"))
    enable_chunked_prefill: bool = field(default=True, metadata=opt(
        "prefill each prompt in one step", flag="--no-chunked-prefill"))
    policy: str = field(default="lpm", metadata=opt(
        "admission order (lpm: longest cached prefix first, without starvation)", name="scheduling_policy",
        registry="scheduling policies"))
    max_wait_steps: int = field(default=64, metadata=opt(
        "under lpm, a request that has waited this many steps goes first"))

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be >= 1, got {self.max_wait_steps}")


# -- offload tiers (docs/offload.md) ------------------------------------------
# Each tier's first field is the one that turns it on in the flat options; the
# registry in kvserve/offload/registry.py maps each config class to its transport.

@dataclass(frozen=True)
class HostConfig:
    """Host (CPU) memory: an LRU dict bounded in bytes."""

    capacity_bytes: int = field(metadata=opt("host-memory tier size in GiB", name="host_cache_gb", unit="GiB",
                                             default_text="off", group="offload"))

    def __post_init__(self) -> None:
        _positive("host tier capacity_bytes", self.capacity_bytes)


@dataclass(frozen=True)
class DiskConfig:
    """A directory of one file per block; persists across restarts.

    ``fsync`` flushes each file before it is renamed into place, so a power loss leaves
    either the whole block or none. Without it a kill -9 is still safe (the page cache
    survives the process); a power loss may leave a damaged file, which the checksum
    catches on read.
    """

    path: str = field(metadata=opt(
        "disk tier directory; persists across restarts, one engine per directory", name="disk_cache_dir",
        flag="--disk-cache", metavar="DIR", default_text="off", group="offload"))
    capacity_bytes: int = field(default=16 << 30, metadata=opt(
        "disk tier size in GiB", name="disk_cache_gb", unit="GiB", group="offload"))
    fsync: bool = field(default=True, metadata=opt(
        "do not fsync each block file (a power loss may then damage recent blocks; the checksum catches it)",
        name="disk_fsync", flag="--no-disk-fsync", group="offload"))

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("disk tier needs a directory path")
        _positive("disk tier capacity_bytes", self.capacity_bytes)


@dataclass(frozen=True)
class RedisConfig:
    """A Redis server shared by engines. Keys are ``kvserve:{namespace}:{key hex}``.

    ``namespace`` should name the model and KV format so that engines that cannot use
    each other's blocks do not share a key space; None lets the engine derive it from
    the blocks' format tag. The password, if any, goes in the URL
    (``redis://:secret@host:6379/0``). A server that does not answer within
    ``timeout_s`` is marked down; it is tried again after ``backoff_s``, doubling per
    failed try up to ``max_backoff_s``.
    """

    url: str = field(metadata=opt("Redis tier shared by engines, e.g. redis://host:6379/0", name="redis_url",
                                  default_text="off", group="offload"))
    namespace: str | None = None
    ttl_s: float | None = field(default=None, metadata=opt(
        "expire Redis blocks after this many seconds", name="redis_ttl_s", default_text="never", group="offload"))
    timeout_s: float = field(default=0.5, metadata=opt(
        "seconds before an unanswered Redis call marks the server down", name="redis_timeout_s", group="offload"))
    backoff_s: float = field(default=5.0, metadata=opt(
        "seconds before a down Redis is tried again", name="redis_backoff_s", group="offload"))
    max_backoff_s: float = field(default=60.0, metadata=opt(
        "the backoff doubles per failed try up to this many seconds", name="redis_max_backoff_s",
        group="offload"))

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.namespace is not None and (not self.namespace or any(c.isspace() for c in self.namespace)):
            raise ValueError(f"redis tier namespace must be non-empty without spaces, got {self.namespace!r}")
        if self.ttl_s is not None:
            _positive("redis_ttl_s", self.ttl_s)
        _positive("redis_timeout_s", self.timeout_s)
        _positive("redis_backoff_s", self.backoff_s)
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"redis_max_backoff_s ({self.max_backoff_s}) is below redis_backoff_s ({self.backoff_s})")


TierConfig = HostConfig | DiskConfig | RedisConfig
TIER_CONFIGS: tuple[type[TierConfig], ...] = (HostConfig, DiskConfig, RedisConfig)   # lookup order
SPEC_METHODS = ("ngram", "suffix", "self", "draft")    # kvserve/speculative/: proposers.py, suffix.py, drafters.py
_NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
_SUFFIX_KEYS = ("suffix_max_depth", "suffix_min_match", "suffix_min_prob", "suffix_max_global_tokens")
_MODEL_KEYS = ("quantization", "skip_layers")
_METHOD_KEYS = {"ngram": _NGRAM_KEYS, "suffix": _SUFFIX_KEYS, "self": _MODEL_KEYS, "draft": _MODEL_KEYS}
_ALL_METHOD_KEYS = (*_NGRAM_KEYS, *_SUFFIX_KEYS, *_MODEL_KEYS)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative.md): a proposer drafts up to ``num_speculative_tokens``
    tokens after a running request's last one and the model checks them in the next step.

    ``ngram`` (prompt lookup) proposes what followed the most recent earlier occurrence of the
    last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens of the prompt and output.
    ``suffix`` (suffix decoding) counts the substrings of up to ``suffix_max_depth`` tokens of
    each request's prompt and output and of finished requests' outputs (the last
    ``suffix_max_global_tokens`` tokens of them), matches the longest suffix of at least
    ``suffix_min_match`` tokens and drafts the most frequent continuation while each token's
    share of what followed there is at least ``suffix_min_prob``.
    ``self``: the served model drafts, over its own KV cache, with the layers in
    ``skip_layers`` left out and its weights in the format ``quantization`` names (default:
    the served weights themselves, shared). ``draft``: the model at ``model`` (same vocabulary)
    drafts, over a paged cache of its own; ``quantization`` and ``skip_layers`` apply to it.
    Given as vLLM's ``--speculative-config`` JSON: ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}``."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    suffix_max_depth: int = 32                   # suffix: the longest substring counted (match + draft)
    suffix_min_match: int = 2                    # suffix: the fewest last tokens a match takes
    suffix_min_prob: float = 0.1                 # suffix: a drafted token's least share of what followed
    suffix_max_global_tokens: int = 32768        # suffix: finished outputs' tokens kept (0: none)
    model: str | None = None                     # draft: the drafting model (a path or name, as --model)
    quantization: str | None = None              # self / draft: the drafting weights' format (--weight-format)
    skip_layers: tuple[int, ...] | None = None   # self / draft: layers the draft leaves out (None: the default)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", *_NGRAM_KEYS, "suffix_max_depth", "suffix_min_match"):
            _check_count(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        self._check_suffix()
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative config: model must be a path or name, got {self.model!r}")
        if self.method != "draft" and self.model is not None:
            raise ValueError(f'speculative config: "model" is the draft method\'s; method {self.method!r} '
                             f'{"drafts with the served model" if self.method == "self" else "needs no model"}')
        if self.quantization is not None and (not isinstance(self.quantization, str) or not self.quantization):
            raise ValueError(f"speculative config: quantization must be a weight format name, got {self.quantization!r}")
        if self.skip_layers is not None:
            layers = self.skip_layers
            if not isinstance(layers, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) \
                    or len(set(layers)) != len(layers):
                raise ValueError(f"speculative config: skip_layers must be distinct layer indices >= 0, got {layers!r}")
            object.__setattr__(self, "skip_layers", tuple(sorted(layers)))

    def _check_suffix(self) -> None:
        p, cap = self.suffix_min_prob, self.suffix_max_global_tokens
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"speculative config: suffix_min_prob must be a number in [0, 1], got {p!r}")
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise ValueError(f"speculative config: suffix_max_global_tokens must be an integer >= 0, got {cap!r}")
        need = self.num_speculative_tokens + self.suffix_min_match
        if self.method == "suffix" and self.suffix_max_depth < need:
            raise ValueError(f"speculative config: suffix_max_depth ({self.suffix_max_depth}) must hold a match of "
                             f"suffix_min_match ({self.suffix_min_match}) and a draft of num_speculative_tokens "
                             f"({self.num_speculative_tokens}): at least {need}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config a ``--speculative-config`` JSON object gives; ValueError naming what is wrong
        (bad JSON, an unknown key, a missing method, a bad value, a key the method does not use)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not JSON: {e}") from None
        if not isinstance(data, dict):   # a user's text, not a programming error: ValueError as the rest
            raise ValueError(f"speculative config must be a JSON object, got {text!r:.80}")  # noqa: TRY004
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in data:
            raise ValueError(f"speculative config needs a method ({', '.join(SPEC_METHODS)})")
        own = _METHOD_KEYS.get(data["method"])     # None: an unknown method, refused by name below
        unused = [] if own is None else [k for k in _ALL_METHOD_KEYS if k in data and k not in own]
        if unused:
            raise ValueError(f"speculative config: method {data['method']!r} does not use {', '.join(unused)}")
        return cls(**data)


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative config: {name} must be an integer >= 1, got {value!r}")


DTYPES = ("auto", "float32", "float16", "bfloat16")
LINEAR_BACKENDS = ("auto", "torch", "onednn")   # kvserve/model/linear.py
MAX_MODEL_LEN_FITS = ("refuse", "lower")         # kvserve/engine/build.py fit_max_model_len


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. ``tiers``: the offload tiers below the device
    pool, in lookup order; evicted blocks are written to every one (write-through), so a
    block that falls out of host memory is still on disk or in Redis."""

    model: str | None = None
    device: str = field(default="auto", metadata=opt("auto, cpu, cuda or cuda:N"))
    dtype: str = field(default="auto", metadata=opt(
        "compute dtype (auto: float32 on CPU, the model's dtype on CUDA)", choices=DTYPES))
    max_model_len: int | None = field(default=None, metadata=opt("context window", default_text="the model's"))
    max_model_len_fit: str | None = field(default=None, metadata=opt(
        "when the KV cache cannot hold one request of max_model_len tokens: refuse to start, naming both and the "
        "flags that fix it, or lower max_model_len to what the cache holds (logged)", choices=MAX_MODEL_LEN_FITS,
        default_text="refuse for kvserve serve; for the Python API none: only a request that could not fit is "
                     "refused"))
    seed: int = field(default=0, metadata=opt("seed of unseeded sampling", flag="--engine-seed"))
    attention_backend: str = field(default="auto", metadata=opt(
        "how attention reads the KV cache: torch (gather and decode, the reference), cpu (C++ kernel "
        "reading every format in place), triton (CUDA), auto (the fastest available)",
        registry="attention backends"))
    linear_backend: str = field(default="auto", metadata=opt(
        "how the dense layers multiply: onednn (weights packed once into oneDNN's layout; CPU float32), "
        "torch (F.linear), auto (onednn where it runs, else torch)", choices=LINEAR_BACKENDS))
    weight_format: str = field(default="auto", metadata=opt(
        "how the weights are held and multiplied: native (dequantized to the compute dtype), gguf (the GGUF "
        "file's own blocks read in place: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), int8[-gG], int8-ch, int4[-gG] (quantized at "
        "load), with +outN outlier channels in float32; auto: gguf where a kernel reads the file's blocks, "
        "else native (docs/weights.md)"))
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    tiers: tuple[TierConfig, ...] = ()
    write_through: bool = field(default=False, metadata=opt(
        "write every computed full KV block to the shared tiers (Redis) at once, in the background, not only "
        "when the device evicts it: engine replicas then find each other's history (docs/cluster.md)",
        flag="--write-through", group="offload"))
    cuda_graphs: bool = field(default=False, metadata=opt(
        "replay decode steps from CUDA graphs, one per batch-size bucket (powers of two up to --max-num-seqs), "
        "so a step's kernel launches become one; steps that do not fit (prefill chunks, drafts, KV budgets, "
        "contexts over 8,192 tokens) run eagerly. Needs CUDA, the triton attention backend and a KV format without residual rows (not kivi, "
        "+outN); refused otherwise, saying why (docs/attention.md)", flag="--cuda-graphs"))
    speculative_config: str | None = field(default=None, metadata=opt(
        "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 3, \"prompt_lookup_min\": 1}; methods ngram, suffix, self, draft (docs/speculative.md); "
        "a dict as a keyword",
        default_text="off", metavar="JSON"))

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", json.dumps(self.speculative_config))
        if self.speculative_config is not None:
            SpeculativeConfig.from_json(self.speculative_config)   # refused here, before any model loads
        if self.write_through and not self.tiers:
            raise ValueError("write_through needs a shared offload tier to write to: give redis_url (--redis-url)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {self.linear_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_model_len_fit is not None and self.max_model_len_fit not in MAX_MODEL_LEN_FITS:
            raise ValueError(f"max_model_len_fit must be one of {', '.join(MAX_MODEL_LEN_FITS)}, "
                             f"got {self.max_model_len_fit!r}")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None: no speculative decoding)."""
        return None if self.speculative_config is None else SpeculativeConfig.from_json(self.speculative_config)
