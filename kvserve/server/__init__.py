"""The OpenAI-compatible HTTP server: ``kvserve serve`` (see docs/server.md)."""
