"""The worker: model, paged KV cache, sampler. One class runs in-process or behind ZMQ."""
