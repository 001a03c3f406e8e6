"""Benchmarks: `stoker bench serve` (online load generator for any OpenAI-compatible server)
and `stoker bench offline` (the repo's offline throughput benchmark)."""
