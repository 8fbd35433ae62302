"""Speculative decoding: proposers draft tokens, the engine checks them in its next step (docs/speculative.md)."""
