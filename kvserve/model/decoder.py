"""The model interface: what the runner, blending, speculation, eval and the planner call.

A decoder is an embedding, layers and a head. ``forward`` runs it over the paged KV cache;
blending, calibration and drafting compose the two halves of a layer around attention of their
own (``layer_qkv`` before it, ``layer_output`` after it). A family (kvserve/model/families.py)
writes only its layers' halves and its weights' names; the loop, the RoPE of each layer, the
window each layer attends over and the logits are here.

Plain tensors, no nn.Module: each weight matrix is a ``Product`` (kvserve/model/linear.py) in
the weight format the engine chose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import ClassVar, TypeVar

import torch

from kvserve.attention.paged import AttentionMetadata, paged_attention
from kvserve.config import ModelConfig
from kvserve.kv.storage import KVStorage
from kvserve.model.cpu_extension import load_extension
from kvserve.model.linear import DenseProducts, Embedding, Product, Products, TorchLinear, Weight, rms_norm
from kvserve.model.rope import Rope, RopeAngles, layer_ropes

#: a step's rotation angles, one per distinct RoPE of the model (``Decoder.angles``)
StepAngles = tuple[RopeAngles, ...]
#: a layer's bound write (layer, key, value) and attention (layer, q, out) -> the output
LayerWrite = Callable[[int, torch.Tensor, torch.Tensor], None]
LayerAttend = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
LayerT = TypeVar("LayerT")


class Decoder(ABC):
    """A causal decoder over a paged KV cache (the contract every family implements)."""

    #: added to the final norm's weight (Gemma's norms scale by 1 + weight)
    norm_plus: ClassVar[float] = 0.0

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight], device: torch.device,
                 dtype: torch.dtype, products: Products | None = None) -> None:
        """``weights``: Hugging Face names to float tensors or packed GGUF blocks; ``products``:
        the weight format that turns them into products (default: float, ``F.linear``)."""
        self.config = config
        self.device = device
        self.dtype = dtype
        self.products = products if products is not None else DenseProducts(TorchLinear(), device, dtype)
        self._weights = weights
        embed = self.weight("model.embed_tokens.weight")
        tied = config.tie_word_embeddings
        self.lm_head = self.products.product("lm_head", [embed if tied else self.weight("lm_head.weight")],
                                             is_head=True)
        self.embedding: Embedding = self.products.embedding(embed, self.lm_head if tied else None)
        self.final_norm = self.vector("model.norm.weight", plus=self.norm_plus)
        # one Rope per distinct base (Gemma 3: two), each layer pointing at its own
        bases = layer_ropes(config)
        distinct = list(dict.fromkeys(bases))
        self.ropes = [Rope(b, config.num_heads, config.num_kv_heads, device, dtype) for b in distinct]
        self.rope_of_layer = tuple(distinct.index(b) for b in bases)
        self._ext = load_extension() if device.type == "cpu" and dtype == torch.float32 else None
        self._bound: tuple[tuple[Callable[..., object], ...], ...] | None = None
        self.windows = config.sliding_windows
        self.scale = config.query_scale
        self.build_layers()
        del self._weights           # the products hold what they need

    # --- what a family writes ---------------------------------------------------------------
    @abstractmethod
    def build_layers(self) -> None:
        """Build each layer's products and norms from ``self.weight`` / ``self.vector``."""

    @abstractmethod
    def layer_qkv(self, layer: int, h: torch.Tensor,
                  angles: StepAngles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H, D], keys and values [T, Hkv, D] of ``layer`` for hidden states ``h``
        [T, hidden]; queries and keys rotated at the layer's ``angles`` (``self.angles`` of the
        tokens' positions)."""

    @abstractmethod
    def layer_output(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Hidden states after ``layer``, from those before it and its attention output [T, H, D]
        (``h`` may be updated in place: callers use what this returns)."""

    @abstractmethod
    def layer_products(self) -> Sequence[Product]:
        """Every layer's products (what a decode step reads, with the head)."""

    @abstractmethod
    def layer_vectors(self) -> Sequence[torch.Tensor]:
        """Every layer's norm weights."""

    # --- shared ------------------------------------------------------------------------------
    def weight(self, name: str) -> Weight:
        if name not in self._weights:
            raise ValueError(f"weight {name!r} missing from the checkpoint")
        return self._weights[name]

    def vector(self, name: str, plus: float = 0.0) -> torch.Tensor:
        """A norm weight or bias in the compute dtype (``plus`` added in float32 first: Gemma's
        norms scale by 1 + weight)."""
        t = self.weight(name)
        assert isinstance(t, torch.Tensor), name     # norms and biases are never quantized
        return (t.float() + plus if plus else t).to(device=self.device, dtype=self.dtype).contiguous()

    def norm_add(self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``h + rms_norm(x, weight)`` (``h`` updated in place by one C++ call on the CPU in float32)."""
        if self._ext is not None and h.is_contiguous() and x.is_contiguous():
            self._ext.norm_add(h, x, weight, self.config.rms_norm_eps)
            return h
        return h + rms_norm(x, weight, self.config.rms_norm_eps)

    def rope_of(self, layer: int) -> Rope:
        return self.ropes[self.rope_of_layer[layer]]

    def angles(self, positions: torch.Tensor) -> StepAngles:
        """The rotation angles of tokens at ``positions``, under each of the model's RoPEs."""
        return tuple(rope.angles(positions) for rope in self.ropes)

    def layer_angles(self, layer: int, angles: StepAngles) -> RopeAngles:
        return angles[self.rope_of_layer[layer]]

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights a decode step reads: every layer's products and norms, the final norm
        and the LM head (a tied embedding is the head; the lookup reads a row)."""
        vectors = [self.final_norm, *self.layer_vectors()]
        return (sum(p.nbytes for p in (self.lm_head, *self.layer_products()))
                + sum(t.numel() * t.element_size() for t in vectors))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> the first layer's input [T, hidden] (scaled where the family does)."""
        h = self.embedding(input_ids)
        multiplier = self.config.embedding_multiplier
        # in the compute dtype, as the reference scales it
        return h if multiplier is None else h * torch.tensor(multiplier, dtype=h.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVStorage,
                meta: AttentionMetadata, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm. ``layers``: the layers to run,
        in order (default: all; a self-drafting pass leaves some out, kvserve/speculative/drafters.py)."""
        h = self.embed(input_ids)
        angles = self.angles(positions)
        order = range(self.config.num_layers) if layers is None else layers
        return self.final_norm_of(self.run_layers(h, angles, cache, meta, order))

    def run_layers(self, h: torch.Tensor, angles: StepAngles, cache: KVStorage, meta: AttentionMetadata,
                   layers: Sequence[int]) -> torch.Tensor:
        """The hidden states after ``layers`` (in order) from the first one's input ``h``. A family
        may run a step it can take through direct calls (``LlamaModel``) its own way."""
        for i in layers:
            q, k, v = self.layer_qkv(i, h, angles)
            attn = paged_attention(q, k, v, i, cache, meta, self.scale, self.windows[i])
            h = self.layer_output(i, h, attn)
        return h

    def bound_layers(self) -> tuple[tuple[Callable[..., object], ...], ...]:
        """Each layer's calls for a family's direct loop (``bind_layers``), bound once; empty off
        the CPU or in another dtype than float32 (the kernels' own)."""
        if self._bound is None:
            self._bound = self.bind_layers() if self.device.type == "cpu" and self.dtype == torch.float32 else ()
        return self._bound

    def bind_layers(self) -> tuple[tuple[Callable[..., object], ...], ...]:
        """A family with a direct loop: each layer's products as direct calls (``Product.bound``),
        or empty where some product has none."""
        return ()

    def bind_each_layer(self, layers: Sequence[LayerT],
                        forms: Callable[[LayerT], Sequence[tuple[Product, str, torch.Tensor | None]]]
                        ) -> tuple[tuple[Callable[..., object], ...], ...]:
        """``bind_layers`` from each layer's (product, form, norm weight) calls (``Product.bound``,
        the norms at ``rms_norm_eps``); empty where some product has none, or the layers' products
        differ in shape (the loop's buffers are made once a step)."""
        eps, calls = self.config.rms_norm_eps, []
        shapes = {tuple(product.rows for product, _, _ in forms(layer)) for layer in layers}
        for layer in layers if len(shapes) == 1 else ():
            bound = [product.bound(form, norm, eps) for product, form, norm in forms(layer)]
            if any(call is None for call in bound):
                return ()
            calls.append(tuple(call for call in bound if call is not None))
        return tuple(calls)

    def forget_bound_calls(self) -> None:
        """Drop what a family bound from its products for its direct loop, so that it binds them
        again as they are now (a benchmark that wraps the products' methods calls this)."""
        self._bound = None

    def step_buffers(self, h: torch.Tensor, qkv_rows: int,
                     gate_up_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A direct loop's buffers for ``h``'s rows, made once a step and reused by every layer:
        the fused Q/K/V rows, their values' view [n, kv heads, head dim], the attention's output
        [n, heads, head dim] and the gate/up rows."""
        cfg, n = self.config, h.shape[0]
        qkv = h.new_empty(n, qkv_rows)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(n, cfg.num_kv_heads, cfg.head_dim)
        return qkv, v, h.new_empty(n, cfg.num_heads, cfg.head_dim), h.new_empty(n, gate_up_rows)

    def step_calls(self, cache: KVStorage, meta: AttentionMetadata) -> tuple[list[LayerWrite], list[LayerAttend]] | None:
        """Each layer's write and attention with the step bound (its group's write plan, its
        window), where every group attends the whole step in one backend call; else None."""
        metas = meta.group_metas
        batches = [m.one_kernel_batch for m in metas]
        if any(b is None for b in batches):
            return None
        writers = [cache.step_writer(m.write) for m in metas]
        attends: dict[tuple[int, int | None], LayerAttend] = {}
        writes, reads = [], []
        for i, window in enumerate(self.windows):
            g = meta.group_of_layer[i] if meta.groups is not None else 0
            if (g, window) not in attends:
                batch = batches[g]
                assert batch is not None
                attends[g, window] = metas[g].backend.step_attend(
                    cache, batch if window is None else replace(batch, window=window), self.scale)
            writes.append(writers[g])
            reads.append(attends[g, window])
        return writes, reads

    def final_norm_of(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm, the step between the last layer and ``compute_logits``."""
        return rms_norm(h, self.final_norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

