"""Greedy agreement: how long a compressed cache keeps generating the same tokens.

For each chat prompt, ``max_tokens`` tokens are generated greedily (eos does not
stop generation, so both runs have exactly ``max_tokens``) with the compressed
cache and with the uncompressed reference; the prompt's score is the length of
their common prefix over ``max_tokens``, and agreement is the mean over prompts.
One early divergence counts fully: everything after it is a different text.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kv.prefix import common_prefix_len

# Varied, short chat turns (questions, instructions, code, lists); applied through
# the model's chat template.
CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea at night.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "Give me three tips for learning a new language.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize the story of Little Red Riding Hood in a few sentences.",
    "What are the main differences between a cat and a dog as pets?",
    "How do I make a cup of green tea?",
    "List the planets of the solar system in order from the sun.",
    "Why is the sky blue?",
    "Describe a busy morning at a train station.",
    "What should I pack for a weekend hiking trip?",
)


def agreement(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]], max_tokens: int) -> float:
    """Mean over prompts of common-prefix length / ``max_tokens`` (1.0: identical)."""
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs for {len(references)} references")
    if not outputs:
        raise ValueError("agreement needs at least one prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for seq in (*outputs, *references):
        if len(seq) > max_tokens:
            raise ValueError(f"a generation has {len(seq)} tokens, more than max_tokens = {max_tokens}")
    return sum(common_prefix_len(o, r) / max_tokens for o, r in zip(outputs, references)) / len(outputs)
