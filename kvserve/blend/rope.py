"""Moving cached keys to other positions: RoPE re-rotation.

A key is stored rotated by its position: ``k_p = R(p) k``, where ``R(p)`` turns each channel
pair (j, j + D/2) by ``p * inv_freq[j]`` (``apply_rope`` in kvserve/model/rope.py). Since
``R(p1) R(p0)^T = R(p1 - p0)``, moving a key from p0 to p1 is one more rotation. It is
composed from the model's own float32 tables at p0 and p1 rather than from the angle
``(p1 - p0) * inv_freq``: the result then differs from a key computed at p1 by the float32
rounding of a few products, not by the rounding of the angles, which grows with the position.

    stored   R(p0) k        (cos0, sin0 = table rows at p0)
    moved    R(d) R(p0) k   cos_d = cos1 cos0 + sin1 sin0,  sin_d = sin1 cos0 - cos1 sin0
           = R(p1) k        (cos0^2 + sin0^2 = 1 up to float32 rounding)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.config import ModelConfig
from kvserve.model.rope import apply_rope, rope_tables


class RopeTables:
    """The model's rotation tables (float32, CPU), for re-rotating keys of any dtype."""

    def __init__(self, config: ModelConfig) -> None:
        self.cos, self.sin = rope_tables(config)

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def rotation(self, from_positions: torch.Tensor, to_positions: torch.Tensor,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin [n, 1, head_dim] that turn keys rotated at ``from_positions`` [n]
        into keys rotated at ``to_positions`` [n] (``apply_rope`` takes them), on ``device``."""
        n = from_positions.shape[0]
        if to_positions.shape != (n,) or from_positions.shape != (n,):
            raise ValueError(f"{n} keys need {n} positions each way, got {tuple(from_positions.shape)} "
                             f"and {tuple(to_positions.shape)}")
        for name, pos in (("from", from_positions), ("to", to_positions)):
            if n and not 0 <= int(pos.min()) <= int(pos.max()) < self.num_positions:
                raise ValueError(f"{name} positions {int(pos.min())}..{int(pos.max())} are outside the "
                                 f"model's {self.num_positions}")
        src, dst = from_positions.cpu(), to_positions.cpu()
        cos0, sin0 = self.cos[src].double(), self.sin[src].double()
        cos1, sin1 = self.cos[dst].double(), self.sin[dst].double()
        cos_d = (cos1 * cos0 + sin1 * sin0).float().to(device).unsqueeze(1)
        sin_d = (sin1 * cos0 - cos1 * sin0).float().to(device).unsqueeze(1)
        return cos_d, sin_d

    def rerotate(self, keys: torch.Tensor, from_positions: torch.Tensor,
                 to_positions: torch.Tensor) -> torch.Tensor:
        """``keys`` [n, heads, head_dim] rotated at ``from_positions`` [n], rotated instead at
        ``to_positions`` [n]; computed in float32, returned in ``keys.dtype`` (a new tensor)."""
        if from_positions.shape[0] != keys.shape[0]:
            raise ValueError(f"{keys.shape[0]} keys need {keys.shape[0]} positions each way, got "
                             f"{tuple(from_positions.shape)} and {tuple(to_positions.shape)}")
        return self.apply(keys, self.rotation(from_positions, to_positions, keys.device))

    @staticmethod
    def apply(keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``keys`` turned by a ``rotation`` (float32 math, ``keys.dtype`` out)."""
        return apply_rope(keys.float(), *rotation).to(keys.dtype)

    def move_all(self, keys: Sequence[torch.Tensor], from_position: int, to_position: int) -> list[torch.Tensor]:
        """Each layer's ``keys`` of consecutive positions ``from_position, ...`` moved to
        ``to_position, ...`` (one rotation, computed once for every layer)."""
        if from_position == to_position or not keys:
            return [k.clone() for k in keys]
        n = keys[0].shape[0]
        rotation = self.rotation(torch.arange(from_position, from_position + n),
                                 torch.arange(to_position, to_position + n), keys[0].device)
        return [self.apply(k, rotation) for k in keys]

    def move(self, keys: torch.Tensor, from_position: int, to_position: int) -> torch.Tensor:
        """``keys`` of consecutive positions ``from_position, ...`` moved to ``to_position, ...``."""
        return self.move_all([keys], from_position, to_position)[0]
