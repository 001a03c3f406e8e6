"""Offline API: `from stoker.services.engine import LLM, SamplingParams`."""

from stoker.common.sampling_params import SamplingParams
from stoker.services.engine.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
