"""KV budgets: a request keeps at most ``kv_budget`` tokens per layer (docs/budgets.md).

``policies`` is the registry of names users type (the engine checks them); ``budgets``
holds the engine-side owner of the per-request states.
"""
