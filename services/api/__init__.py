"""The OpenAI-compatible HTTP api: Starlette + uvicorn, talking to tokenizers over ZeroMQ."""
