"""kvserve: an LLM inference engine whose KV cache is a memory system."""

from kvserve.blend.prompt import Segment, SegmentedPrompt
from kvserve.cache_control import CacheControl, PrefixPin
from kvserve.engine.outputs import RequestOutput
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "CacheControl", "PrefixPin", "RequestOutput", "SamplingParams", "Segment", "SegmentedPrompt"]
__version__ = "0.1.0"
