"""Frozen configuration objects.

Every config is validated in ``__post_init__``; derived values are properties.
Values discovered at run time (number of KV blocks, eos ids) live in the objects
that discover them and are passed explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling of RoPE ("llama3" in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, SmolLM, Qwen2, Mistral)."""

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

    def __post_init__(self) -> None:
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

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.kv_size * element_size


@dataclass(frozen=True)
class CacheConfig:
    """The device KV cache.

    Its size is either ``num_blocks`` or ``memory_bytes`` (turned into blocks once
    the model's bytes per block are known); ``num_blocks`` wins when both are set.
    """

    block_size: int = 16
    memory_bytes: int = 1 << 30
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    cache_salt: str = ""
    kv_format: str = "native"     # a spec such as "int8", "kivi2", "0-1=fp16;2-=kivi2" (docs/kv_formats.md)
    kv_budget: int | None = None  # tokens kept per layer by every request without its own (docs/budgets.md)
    kv_policy: str = "streaming"  # the budget policy of requests that name none
    budget_host_bytes: int = 4 << 30  # host memory for blocks arkvale moves off the device (docs/budgets.md)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.memory_bytes <= 0:
            raise ValueError(f"KV cache memory must be positive, got {self.memory_bytes} bytes")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.budget_host_bytes < 0:
            raise ValueError(f"budget host memory must be >= 0 bytes, got {self.budget_host_bytes}")
        from kvserve.kv.budget.policies import check_budget, get_policy
        policy = get_policy(self.kv_policy)
        if self.kv_budget is not None:
            check_budget(self.kv_budget, policy, self.block_size)

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


SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits and order.

    ``policy``: ``fcfs`` (arrival order), ``priority`` (lower value first, then
    arrival) or ``lpm`` (longest cached prefix first; a request that has waited
    ``max_wait_steps`` steps goes first, so none starves).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    policy: str = "lpm"
    max_wait_steps: int = 64

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose one of {SCHEDULING_POLICIES}")
        if self.max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be >= 1, got {self.max_wait_steps}")


@dataclass(frozen=True)
class OffloadConfig:
    """Tiers below the device pool, in lookup order host -> disk -> redis (docs/offload.md).

    A tier is on when it is given: ``host_cache_bytes > 0``, ``disk_cache_dir``,
    ``redis_url``. Evicted blocks are written to every configured tier (write-through),
    so a block that falls out of host memory is still on disk or in Redis.
    """

    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 16 << 30
    redis_url: str | None = None
    redis_ttl_s: float | None = None
    redis_timeout_s: float = 0.5
    redis_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.host_cache_bytes < 0:
            raise ValueError(f"host cache size must be >= 0 bytes, got {self.host_cache_bytes}")
        if self.disk_cache_bytes <= 0:
            raise ValueError(f"disk cache size must be positive, got {self.disk_cache_bytes} bytes")
        if self.disk_cache_dir is not None and not self.disk_cache_dir:
            raise ValueError("disk cache directory is empty; leave it unset to turn the disk tier off")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        for name in ("redis_timeout_s", "redis_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.redis_ttl_s is not None and not self.redis_ttl_s > 0:
            raise ValueError(f"redis_ttl_s must be positive, got {self.redis_ttl_s}")

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The configured tiers, in lookup order."""
        on = (("host", self.host_cache_bytes > 0), ("disk", self.disk_cache_dir is not None),
              ("redis", self.redis_url is not None))
        return tuple(name for name, is_on in on if is_on)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    device: str = "auto"            # "auto", "cpu", "cuda", "cuda:1"
    dtype: str = "auto"             # "auto": float32 on CPU, the model's dtype on CUDA
    max_model_len: int | None = None
    seed: int = 0
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    offload: OffloadConfig = OffloadConfig()

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
