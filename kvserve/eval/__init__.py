"""Quality of compressed KV caches (``kvserve eval``): perplexity with sliding windows,
greedy agreement with the uncompressed cache, passkey retrieval; transformers'
quantized cache as the baseline. Results and method: docs/kv_quality.md."""
