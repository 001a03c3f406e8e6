"""The tokenizer service: tokenization, request validation and incremental detokenization."""
