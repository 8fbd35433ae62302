"""Attention over the paged KV cache, reading every block in its stored format.

``layout`` describes what a kernel reads (a half's codec arithmetic, its part tensors,
the batch's block tables); ``reference`` is the slow, obviously right version every
backend is tested against.
"""
