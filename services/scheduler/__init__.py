"""The scheduler: sans-IO policy (queues, token budget, KV blocks) and its service shell."""
