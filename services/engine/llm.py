"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from stoker.common.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from stoker.common.finish import finish_reason, text_token_ids  # noqa: E402
from stoker.common.messages import TokenLogprobs  # noqa: E402
from stoker.common.model_config import ModelConfig  # noqa: E402
from stoker.common.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from stoker.common.tokenizer_files import load_tokenizer  # noqa: E402
from stoker.services.engine.core import EngineCore  # noqa: E402
from stoker.services.tokenizer.detokenizer import IncrementalDetokenizer  # noqa: E402
from stoker.services.tokenizer.grammar_compile import GrammarCompiler  # noqa: E402
from stoker.services.tokenizer.pieces import PieceTables  # noqa: E402

Prompt = str | Sequence[int]


@dataclasses.dataclass
class CompletionMetrics:
    """When this completion was queued, got its first token and finished (time.monotonic()
    seconds, as the engine loop saw them), so a caller can tell prefill from decode."""

    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def decode_seconds(self) -> float | None:
        """From the first token to the last: the decode phase alone."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    metrics: CompletionMetrics = dataclasses.field(default_factory=CompletionMetrics)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # SamplingParams.prompt_logprobs, as vLLM's: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    # The first completion's fields, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


@dataclasses.dataclass
class _Pending:
    output: CompletionOutput
    detok: IncrementalDetokenizer
    params: SamplingParams
    parent: RequestOutput


class LLM:
    def __init__(
        self, model: str | None = None, overlap: bool | None = None, **engine_options
    ) -> None:
        """`overlap`: run each step on a runner thread while the next is planned (EngineCore;
        None: on CUDA only)."""
        # Offline there is no TTFT to protect: no prompt-chunk cap unless asked (SmolLM2's
        # offline benchmark ran 3-4 % faster without the CPU serving default of 512; as vLLM,
        # whose offline LLM class also takes a larger step budget than its server).
        engine_options.setdefault("prefill_chunk_tokens", 0)
        config = EngineConfig(model=str(model or DEFAULT_MODEL), **engine_options)
        self.engine = EngineCore(config, overlap)
        self.tokenizer = load_tokenizer(config.model)
        self.pieces = PieceTables(self.tokenizer)  # built on first use
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built by the first structured request

    def close(self) -> None:
        """Stop the other ranks now (tensor_parallel_size > 1); they also stop when this object
        is collected or the process exits."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _compiled(self, params: SamplingParams) -> SamplingParams:
        """Params whose constraint carries its grammar (docs/structured-outputs.md); raises
        ValueError for an invalid one, as the server's 400."""
        structured = params.structured
        if structured is None or structured.grammar:
            return params
        if self._grammars is None:
            cfg = self.engine.config
            model_cfg = ModelConfig.from_folder(cfg.model)
            eos = model_cfg.eos_token_ids[0] if model_cfg.eos_token_ids else None
            self._grammars = GrammarCompiler(self.tokenizer, model_cfg.vocab_size, eos)
        compiled = self._grammars.compile_sync(structured)
        ready = _replace_structured(structured, grammar=compiled.grammar)
        return _replace(params, structured=ready)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")

        # Validate everything before queueing anything, so a bad prompt leaves no state behind.
        tokenized = [self._tokenize(p) for p in prompts]
        for (_, ids), params in zip(tokenized, params_list):
            self.engine.check(ids, params)
        params_list = [self._compiled(params) for params in params_list]

        results: list[RequestOutput] = []
        pending: dict[str, _Pending] = {}
        for (text, ids), params in zip(tokenized, params_list):
            parent = RequestOutput(str(next(self._ids)), text, ids, [])
            results.append(parent)
            for index in range(params.n):
                child = params
                if params.n > 1 and params.seed is not None:
                    child = _replace(params, seed=params.seed + index)
                req_id = f"{parent.request_id}-{index}"
                out = CompletionOutput(
                    index, "", [], None, [] if params.logprobs is not None else None
                )
                parent.outputs.append(out)
                detok = IncrementalDetokenizer(self.tokenizer, ids, child, self.pieces)
                pending[req_id] = _Pending(out, detok, child, parent)
                self.engine.add_request(req_id, ids, child)

        show = use_tqdm if use_tqdm is not None else len(pending) >= 16
        bar = tqdm(total=len(pending), desc="generate", unit="req", disable=not show)
        try:
            while self.engine.has_unfinished():
                for update in self.engine.step():
                    item = pending[update.req_id]
                    out = item.output
                    now = time.monotonic()
                    if out.metrics.first_token_time is None and update.new_token_ids:
                        out.metrics.first_token_time = now
                    out.token_ids.extend(update.new_token_ids)
                    if update.logprobs is not None and out.logprobs is not None:
                        out.logprobs.extend(lp for lp in update.logprobs if lp is not None)
                    if update.prompt_logprobs is not None:  # each of n choices has the same
                        item.parent.prompt_logprobs = update.prompt_logprobs
                    engine_finish = update.finish_reason.value if update.finish_reason else None
                    new_ids = text_token_ids(
                        update.new_token_ids,
                        engine_finish,
                        update.request.stop_ids,
                        item.params.include_stop_str_in_output,
                    )
                    out.text += item.detok.add_tokens(new_ids).text
                    if engine_finish is None and item.detok.stopped:
                        self.engine.abort(update.req_id)
                    finish = finish_reason(engine_finish, item.detok.stopped)
                    if finish is not None:
                        out.text += item.detok.finish().text
                        out.finish_reason = finish
                        out.metrics.finished_time = now
                        bar.update(1)
        except BaseException:
            for req_id in pending:
                self.engine.abort(req_id)
            raise
        finally:
            bar.close()
        return results


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    return msgspec.structs.replace(params, **changes)


def _replace_structured(structured: StructuredOutput, **changes) -> StructuredOutput:
    return msgspec.structs.replace(structured, **changes)
