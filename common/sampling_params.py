"""Per-request sampling parameters, shared by the offline API, the HTTP API and the worker."""

from __future__ import annotations

import msgspec


class StructuredOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """A constraint on the output, enforced exactly by a grammar mask (docs/structured-outputs.md).

    kind: json_schema (spec: the schema as JSON text), json_object (spec ""), regex, choice
    (spec: a JSON list of strings), lark (llguidance's Lark dialect) or gbnf (llama.cpp's).
    The api sets kind and spec; the tokenizer process compiles them and fills `grammar`, the
    backend's (llguidance's) grammar text, which is all the worker reads."""

    kind: str
    spec: str = ""
    grammar: str = ""


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True):
    """What to generate and how. Field names and defaults follow vLLM / OpenAI.

    `logprobs=None` returns no logprobs; `logprobs=k` returns the chosen token's logprob
    plus the top-k alternatives (k may be 0).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI)
    structured: StructuredOutput | None = None  # a grammar the output must match
    prompt_logprobs: int | None = None  # logprobs of each prompt token, plus the top-k (vLLM)

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.logit_bias:
            if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias keys must be non-negative token ids")
            limit = self.MAX_LOGIT_BIAS
            if any(not -limit <= b <= limit for b in self.logit_bias.values()):
                raise ValueError(f"logit_bias values must be in [-{limit:g}, {limit:g}]")

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
