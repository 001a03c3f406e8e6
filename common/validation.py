"""Request checks shared by the offline engine and the API, so both reject the same inputs."""

from __future__ import annotations

from collections.abc import Sequence

from stoker.common.sampling_params import SamplingParams


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
) -> int:
    """Raise ValueError for a request that cannot be served; return its effective max_tokens."""
    params.validate()
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    if num_prompt >= max_model_len:
        raise ValueError(
            f"the prompt has {num_prompt} tokens, but the model's context length is "
            f"{max_model_len}; it must be shorter to leave room for output"
        )
    if params.max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={params.max_tokens} plus the prompt's {num_prompt} tokens exceeds the "
            f"model's context length {max_model_len}"
        )
    return params.max_tokens
