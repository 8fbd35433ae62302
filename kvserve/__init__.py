"""kvserve: an LLM inference engine whose KV cache is a memory system."""

from kvserve.engine.outputs import RequestOutput
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
