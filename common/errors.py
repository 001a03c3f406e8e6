"""Errors shared by the modules that read model files (config, GGUF, weights)."""


class ModelLoadError(ValueError):
    """The model folder cannot be served; the message says why."""
