"""Offline API: `from services.engine import LLM, SamplingParams`."""

from common.sampling_params import SamplingParams
from services.engine.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
