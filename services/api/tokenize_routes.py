"""POST /tokenize and /detokenize, in vLLM's request and response shapes.

They answer with the ids a request actually gets: the model's own tokenizer, loaded by the same
function as the tokenizer processes (common.tokenizer_files.load_tokenizer), run through the
same prompt -> ids function (common.prompt_tokens), chat template included. The api does not
otherwise need transformers (it pulls in torch: about 5 s and a few hundred MB), so the
tokenizer is loaded on the first call, not at start-up.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import msgspec

from stoker.common.chat_template_inputs import template_inputs
from stoker.common.model_registry import resolve_model
from stoker.common.prompt_tokens import prompt_token_ids
from stoker.common.tokenizer_files import load_tokenizer
from stoker.services.api import openai_schema
from stoker.services.api.openai_schema import (
    ApiError,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)


class TokenIdStrings:
    """Stands in for TokenStrings when a request sets return_tokens_as_token_ids: every token
    in the logprobs reads "token_id:N" (vLLM's spelling), so clients get exact ids."""

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def bytes(self, token_id: int) -> bytes:
        return self.text(token_id).encode()


def decode_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A body with `messages` is a chat request, like vLLM's union of the two."""
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raw = None  # openai_schema.decode words the error
    chat = isinstance(raw, dict) and "messages" in raw
    return openai_schema.decode(body, TokenizeChatRequest if chat else TokenizeCompletionRequest)


class TokenizerEndpoints:
    def __init__(
        self,
        model_path: str | None,
        served_model_name: str,
        max_model_len: Callable[[], int | None],
        tool_format: str = "",
    ) -> None:
        """tool_format: the api's tool-call format name (common/tool_calls), as requests send it."""
        self._tool_format = tool_format
        self._model_path = model_path
        self._name = served_model_name
        self._max_model_len = max_model_len
        self._tokenizer: Any = None
        self._loading = asyncio.Lock()

    async def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._model_path is None:
                raise ApiError(
                    "this api process was started without its model folder, so it cannot tokenize",
                    status=501,
                    type="server_error",
                )
            async with self._loading:
                if self._tokenizer is None:
                    path = resolve_model(self._model_path)
                    self._tokenizer = await asyncio.to_thread(load_tokenizer, path)
        return self._tokenizer

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._name:
            raise ApiError(
                f"The model `{model}` does not exist.",
                status=404,
                param="model",
                code="model_not_found",
            )

    async def tokenize(self, body: bytes) -> dict[str, Any]:
        req = decode_tokenize(body)
        self._check_model(req.model)
        tok = await self.tokenizer()
        if isinstance(req, TokenizeChatRequest):
            tools = json.dumps(req.tools) if req.tools else None
            messages, template_tools = template_inputs(
                tok, openai_schema.chat_messages(req.messages), tools, self._tool_format
            )
            kwargs: dict[str, Any] = {
                "messages": messages,
                "tools": template_tools,
                "chat_template_kwargs": req.chat_template_kwargs,
                "continue_final_message": req.continue_final_message,
                "add_generation_prompt": req.add_generation_prompt,
                # False is the request path's own default: leave it to the shared function.
                "add_special_tokens": True if req.add_special_tokens else None,
            }
            param = "messages"
        else:
            kwargs = {"prompt": req.prompt, "add_special_tokens": req.add_special_tokens}
            param = "prompt"
        try:
            ids = await asyncio.to_thread(prompt_token_ids, tok, **kwargs)
        except Exception as e:  # an empty prompt, a template that raises: the request's fault
            raise ApiError(str(e) or type(e).__name__, param=param) from None
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self._max_model_len(),
            "tokens": ids,
        }
        if req.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, body: bytes) -> dict[str, Any]:
        req = openai_schema.decode(body, DetokenizeRequest)
        self._check_model(req.model)
        tok = await self.tokenizer()
        bad = next((t for t in req.tokens if t >= len(tok)), None)
        if bad is not None:
            raise ApiError(
                f"token id {bad} is outside the vocabulary (size {len(tok)})", param="tokens"
            )
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}
