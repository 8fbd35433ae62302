"""KV budgets: a request keeps at most ``kv_budget`` tokens per layer (docs/budgets.md).

``policies`` (the registry) has no dependencies inside kvserve, so configs can validate
names; ``budgets`` holds the engine-side owner of the per-request states.
"""
