"""What a device's quantized-weight kernel offers the weight formats (build.py): products of
packed weights, and row lookups of them (a packed or tied embedding)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvserve.model.formats.packing import PackedWeight
from kvserve.model.linear import Embedding, Product


class QuantKernel(ABC):
    """Multiplies packed weights on one device."""

    name: str

    @abstractmethod
    def product(self, packed: PackedWeight) -> Product:
        """``packed`` moved to the device and registered with the kernel."""

    @abstractmethod
    def embedding(self, product: Product) -> Embedding:
        """Row lookups of a product this kernel made (a tied or packed embedding)."""
