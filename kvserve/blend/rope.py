"""Moving cached keys to other positions: RoPE re-rotation.

A key is stored rotated by its position: ``k_p = R(p) k``, where ``R(p)`` turns each channel
pair (j, j + D/2) by ``p * inv_freq[j]`` (``apply_rope`` in kvserve/model/llama.py). Since
``R(p1) R(p0)^T = R(p1 - p0)``, moving a key from p0 to p1 is one more rotation. It is
composed from the model's own float32 tables at p0 and p1 rather than from the angle
``(p1 - p0) * inv_freq``: the result then differs from a key computed at p1 by the float32
rounding of a few products, not by the rounding of the angles, which grows with the position.

    stored   R(p0) k        (cos0, sin0 = table rows at p0)
    moved    R(d) R(p0) k   cos_d = cos1 cos0 + sin1 sin0,  sin_d = sin1 cos0 - cos1 sin0
           = R(p1) k        (cos0^2 + sin0^2 = 1 up to float32 rounding)
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model.llama import apply_rope, rope_tables


class RopeTables:
    """The model's rotation tables (float32, CPU), for re-rotating keys of any dtype."""

    def __init__(self, config: ModelConfig) -> None:
        self.cos, self.sin = rope_tables(config)

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def rerotate(self, keys: torch.Tensor, from_positions: torch.Tensor,
                 to_positions: torch.Tensor) -> torch.Tensor:
        """``keys`` [n, heads, head_dim] rotated at ``from_positions`` [n], rotated instead at
        ``to_positions`` [n]; computed in float32, returned in ``keys.dtype`` (a new tensor)."""
        n = keys.shape[0]
        if from_positions.shape != (n,) or to_positions.shape != (n,):
            raise ValueError(f"{n} keys need {n} positions each way, got {tuple(from_positions.shape)} "
                             f"and {tuple(to_positions.shape)}")
        for name, pos in (("from", from_positions), ("to", to_positions)):
            if n and not 0 <= int(pos.min()) <= int(pos.max()) < self.num_positions:
                raise ValueError(f"{name} positions {int(pos.min())}..{int(pos.max())} are outside the "
                                 f"model's {self.num_positions}")
        src, dst = from_positions.cpu(), to_positions.cpu()
        cos0, sin0 = self.cos[src].double(), self.sin[src].double()
        cos1, sin1 = self.cos[dst].double(), self.sin[dst].double()
        cos_d = (cos1 * cos0 + sin1 * sin0).float().to(keys.device).unsqueeze(1)
        sin_d = (sin1 * cos0 - cos1 * sin0).float().to(keys.device).unsqueeze(1)
        return apply_rope(keys.float(), cos_d, sin_d).to(keys.dtype)

    def move(self, keys: torch.Tensor, from_position: int, to_position: int) -> torch.Tensor:
        """``keys`` of consecutive positions ``from_position, ...`` moved to ``to_position, ...``."""
        if from_position == to_position:
            return keys.clone()
        n = keys.shape[0]
        return self.rerotate(keys, torch.arange(from_position, from_position + n),
                             torch.arange(to_position, to_position + n))
