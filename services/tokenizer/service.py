"""The tokenizer process: prompts -> token ids on the way in, token ids -> text on the way out.

Several run side by side; the api's ROUTER sends each TokenizeRequest to one of them by routing
id, round robin over those heartbeating. Each one
owns the detokenizer state of the requests it admitted, and the scheduler sends their tokens back
to it by routing id, so no state is shared between tokenizers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import msgspec  # noqa: E402
import uvloop  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from stoker.common.addresses import Addresses  # noqa: E402
from stoker.common.chat_template_inputs import template_messages  # noqa: E402
from stoker.common.fairness import let_others_run  # noqa: E402
from stoker.common.finish import finish_reason, text_token_ids  # noqa: E402
from stoker.common.ipc import encoder, tokenize_request_decoder, tokenizer_inbound_decoder  # noqa: E402
from stoker.common.messages import (  # noqa: E402
    Abort,
    GenerateRequest,
    RequestTokens,
    TextBatch,
    TextDelta,
    TokenBatch,
    TokenizeRequest,
    TokenizerHeartbeat,
    pack_ids,
    unpack_ids,
)
from stoker.common.model_config import ModelConfig, resolve_max_model_len  # noqa: E402
from stoker.common.model_registry import resolve_model  # noqa: E402
from stoker.common.prompt_tokens import prompt_token_ids  # noqa: E402
from stoker.common.sampling_params import SamplingParams  # noqa: E402
from stoker.common.tokenizer_files import load_tokenizer  # noqa: E402
from stoker.common.validation import check_request  # noqa: E402
from stoker.common.wire_digest import PROTOCOL  # noqa: E402
from stoker.services.tokenizer.detokenizer import IncrementalDetokenizer  # noqa: E402
from stoker.services.tokenizer.grammar_compile import (  # noqa: E402
    Compiled,
    GrammarCompiler,
    GrammarError,
)
from stoker.services.tokenizer.pieces import PieceTables  # noqa: E402

log = logging.getLogger("stoker.tokenizer")
HEARTBEAT_S = 0.5


@dataclasses.dataclass
class _Request:
    detok: IncrementalDetokenizer
    params: SamplingParams
    stop_ids: frozenset[int]  # token ids whose generation ends the request with "stop"
    prompt_ids: bytes | None = None  # request log, echo: until the first delta takes them
    compiled: Compiled | None = None  # its grammar's compile, reported on the first delta
    prompt_text: str | None = None  # echo of a token-id prompt, until the first delta takes it


class TokenizerService:
    def __init__(
        self,
        model: str | Path,
        tokenizer_id: str,
        addresses: Addresses,
        max_model_len: int | None = None,
        slot: str = "",
        grammar_compile_timeout_s: float = 2.0,
    ) -> None:
        self.id = tokenizer_id
        self.slot = slot
        self.addresses = addresses
        model = resolve_model(model)
        self.tokenizer = load_tokenizer(model)
        # Per-token bytes for byte-level tokenizers, so a token's text is a lookup. Both
        # skip_special_tokens tables are built now (about half a second each for 50k tokens),
        # not in the event loop when a request first asks for one.
        self.pieces = PieceTables(self.tokenizer)
        for skip_special_tokens in (True, False):
            self.pieces.get(skip_special_tokens)
        cfg = ModelConfig.from_folder(model)
        self.vocab_size = cfg.vocab_size
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self.max_model_len = resolve_max_model_len(cfg, max_model_len)
        self.requests: dict[str, _Request] = {}
        self.num_served = 0
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        self.grammars = GrammarCompiler(
            self.tokenizer, cfg.vocab_size, eos, timeout_s=grammar_compile_timeout_s
        )
        self._compiling: set[asyncio.Task[None]] = set()

    # -- sans-IO core (unit-testable without sockets) -------------------------------------------

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return unpack_ids(req.prompt_token_ids)
        messages = tools = None
        if req.messages is not None:
            messages, tools = template_messages(self.tokenizer, req)
        # The same function /tokenize calls, so what it shows is what requests get.
        return prompt_token_ids(
            self.tokenizer,
            prompt=req.prompt,
            messages=messages,
            add_generation_prompt=req.add_generation_prompt,
            tools=tools,
            chat_template_kwargs=(
                json.loads(req.chat_template_kwargs) if req.chat_template_kwargs else None
            ),
            continue_final_message=req.continue_final_message,
        )

    def admit(self, req: TokenizeRequest) -> GenerateRequest | TextDelta:
        """A GenerateRequest for the scheduler, or an error delta for the api."""
        try:
            ids = self.tokenize(req)
            check_request(ids, req.params, self.max_model_len, self.vocab_size)
            prompt_text = self._prompt_text(ids) if req.return_prompt_text else None
        except Exception as e:  # any tokenizer/template failure is the request's fault
            log.info("rejected: %s", e, extra={"request_id": req.req_id})
            return TextDelta(req.req_id, "", b"", error=str(e) or type(e).__name__)
        eos = frozenset() if req.params.ignore_eos else self.eos_ids
        packed = pack_ids(ids)
        self.requests[req.req_id] = _Request(
            IncrementalDetokenizer(self.tokenizer, ids, req.params, self.pieces),
            req.params,
            eos | frozenset(req.params.stop_token_ids),
            packed if req.return_prompt_ids else None,
            prompt_text=prompt_text,
        )
        self.num_served += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("tokenized: %d prompt tokens", len(ids), extra={"request_id": req.req_id})
        return GenerateRequest(req.req_id, packed, req.params, req.arrival_time)

    def _prompt_text(self, ids: list[int]) -> str:
        """The text an echo shows for a token-id prompt: decoded as the outputs are (the backend
        tokenizer, no clean-up of spaces), special tokens kept, as vLLM's echo decodes it."""
        return self.tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)

    async def admit_structured(self, req: TokenizeRequest) -> GenerateRequest | TextDelta:
        """admit(), then the grammar's compile (off this loop, bounded in time): the request goes
        on with the grammar text in its params, or ends with the compile's 4xx."""
        out = self.admit(req)
        structured = req.params.structured
        if not isinstance(out, GenerateRequest) or structured is None:
            return out
        try:
            compiled = await self.grammars.compile(structured)
        except GrammarError as e:
            self.requests.pop(req.req_id, None)
            log.info("grammar rejected: %s", e, extra={"request_id": req.req_id})
            return TextDelta(req.req_id, "", b"", error=str(e), error_status=e.status)
        state = self.requests.get(req.req_id)
        if state is None:  # aborted meanwhile
            return TextDelta(req.req_id, "", b"", finish_reason="abort")
        state.compiled = compiled
        # The worker reads only the grammar: the spec (a schema) need not travel further.
        ready = msgspec.structs.replace(structured, spec="", grammar=compiled.grammar)
        out.params = msgspec.structs.replace(out.params, structured=ready)
        return out

    def detokenize(self, batch: TokenBatch) -> tuple[TextBatch, list[str]]:
        """Text deltas for the api, and ids whose stop string matched (to abort upstream).
        Steady rows stay steady columns, except for requests with stop strings (or prompt ids
        or text still to send), whose text takes the general path."""
        out = TextBatch(self.id, [])
        deltas = out.items
        stopped: list[str] = []
        requests = self.requests
        if batch.steady_req_ids:
            req_ids, texts, kept = out.steady_req_ids, out.steady_texts, []
            for req_id, token in zip(batch.steady_req_ids, unpack_ids(batch.steady_token_ids)):
                state = requests.get(req_id)
                if state is None:
                    continue  # finished here already (stop string): late tokens are dropped
                if state.detok.plain and state.prompt_ids is None and state.prompt_text is None:
                    try:
                        texts.append(state.detok.add_token(token))
                    except Exception as e:
                        self._fail(req_id, e, deltas, stopped)
                        continue
                    req_ids.append(req_id)
                    kept.append(token)
                else:
                    item = RequestTokens(req_id, pack_ids([token]))
                    self._detokenize_general(state, item, deltas, stopped)
            same = len(kept) == len(batch.steady_req_ids)
            out.steady_token_ids = batch.steady_token_ids if same else pack_ids(kept)
        for item in batch.items:
            state = requests.get(item.req_id)
            if state is None:
                continue  # as above
            self._detokenize_general(state, item, deltas, stopped)
        return out, stopped

    def _detokenize_general(
        self, state: _Request, item: RequestTokens, deltas: list[TextDelta], stopped: list[str]
    ) -> None:
        try:
            delta = self._detokenize_one(state, item)
        except Exception as e:
            self._fail(item.req_id, e, deltas, stopped)
            return
        if delta.finish_reason is not None:
            if item.finish_reason is None:  # stop string: the scheduler still runs it
                stopped.append(item.req_id)
            del self.requests[item.req_id]
        deltas.append(delta)

    def _fail(self, req_id: str, e: Exception, deltas: list[TextDelta], stopped: list[str]) -> None:
        """A request whose text could not be decoded ends with an error delta and an abort
        upstream; the others in the batch go on."""
        log.exception("detokenizing failed", extra={"request_id": req_id})
        self.requests.pop(req_id, None)
        stopped.append(req_id)
        error = str(e) or type(e).__name__
        deltas.append(TextDelta(req_id, "", b"", finish_reason="abort", error=error))

    def _detokenize_one(self, state: _Request, item: RequestTokens) -> TextDelta:
        prompt_ids, state.prompt_ids = state.prompt_ids, None
        prompt_text, state.prompt_text = state.prompt_text, None
        compiled, state.compiled = state.compiled, None
        ids = unpack_ids(item.token_ids)
        ids = text_token_ids(
            ids, item.finish_reason, state.stop_ids, state.params.include_stop_str_in_output
        )
        detok = state.detok
        text = detok.add_tokens(ids).text
        finish = finish_reason(item.finish_reason, detok.stopped)
        if finish is not None and not detok.stopped:
            text += detok.finish().text
        return TextDelta(
            item.req_id,
            text,
            item.token_ids,
            finish_reason=finish,
            logprobs=item.logprobs,
            num_prompt_tokens=item.num_prompt_tokens,
            num_cached_tokens=item.num_cached_tokens,
            queue_s=item.queue_s,
            error=item.error,  # the scheduler rejected it (400) or lost it (503)
            error_status=item.error_status,
            num_draft_tokens=item.num_draft_tokens,
            num_accepted_tokens=item.num_accepted_tokens,
            prompt_token_ids=prompt_ids,
            grammar_compile_s=0.0 if compiled is None else compiled.compile_s,
            grammar_cache_hit=compiled is not None and compiled.cache_hit,
            grammar_mask_s=item.grammar_mask_s,
            num_forced_tokens=item.num_forced_tokens,
            prompt_logprobs=item.prompt_logprobs,
            prompt_text=prompt_text,
        )

    # -- IO shell -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        ctx = zmq.asyncio.Context()
        # The api addresses each request to one tokenizer by this id, so when a tokenizer dies
        # it knows which requests died with it.
        requests = ctx.socket(zmq.DEALER)
        requests.setsockopt(zmq.ROUTING_ID, self.id.encode())
        requests.connect(self.addresses.tokenizer_requests)
        scheduler = ctx.socket(zmq.DEALER)
        scheduler.setsockopt(zmq.ROUTING_ID, self.id.encode())
        scheduler.connect(self.addresses.scheduler)
        api = ctx.socket(zmq.PUSH)
        api.connect(self.addresses.api_inbound)
        tasks = [
            asyncio.create_task(self._requests_loop(requests, scheduler, api)),
            asyncio.create_task(self._tokens_loop(scheduler, api)),
            asyncio.create_task(self._heartbeat_loop(api)),
        ]
        waiter = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not waiter and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            for t in [*tasks, waiter]:
                t.cancel()
            await asyncio.gather(*tasks, waiter, return_exceptions=True)
            ctx.destroy(linger=0)

    async def _requests_loop(self, requests: zmq.asyncio.Socket, scheduler, api) -> None:
        while True:
            frames = await requests.recv_multipart()
            try:
                req = tokenize_request_decoder.decode(frames[-1])
            except msgspec.DecodeError:
                log.exception("dropping a malformed TokenizeRequest")
                continue
            if req.params.structured is not None:
                # Compiles overlap: each waits in its own task while this loop goes on.
                task = asyncio.create_task(self._admit_structured(req, scheduler, api))
                self._compiling.add(task)
                task.add_done_callback(self._compiling.discard)
                continue
            await self._forward(self.admit(req), scheduler, api)
            await let_others_run()  # the token stream and heartbeats share this loop

    async def _admit_structured(self, req: TokenizeRequest, scheduler, api) -> None:
        await self._forward(await self.admit_structured(req), scheduler, api)

    async def _forward(self, out: GenerateRequest | TextDelta, scheduler, api) -> None:
        if isinstance(out, GenerateRequest):
            await scheduler.send(encoder.encode(out))
        else:
            await api.send(encoder.encode(TextBatch(self.id, [out])))

    async def _tokens_loop(self, scheduler: zmq.asyncio.Socket, api) -> None:
        while True:
            frames = await scheduler.recv_multipart()
            try:
                batch = tokenizer_inbound_decoder.decode(frames[-1])
            except msgspec.DecodeError:
                log.exception("dropping a malformed TokenBatch")
                continue
            out, stopped = self.detokenize(batch)
            if stopped:
                await scheduler.send(encoder.encode(Abort(stopped, reason="stop")))
            if out.items or out.steady_req_ids:
                await api.send(encoder.encode(out))
            await let_others_run()  # new requests and heartbeats share this loop

    async def _heartbeat_loop(self, api: zmq.asyncio.Socket) -> None:
        pid = os.getpid()
        while True:
            beat = TokenizerHeartbeat(self.id, pid, self.num_served, self.slot, PROTOCOL)
            await api.send(encoder.encode(beat))
            await asyncio.sleep(HEARTBEAT_S)


def serve(
    model: str,
    tokenizer_id: str,
    max_model_len: int | None = None,
    slot: str = "",
    grammar_compile_timeout_s: float = 2.0,
) -> None:

    async def main() -> None:
        service = TokenizerService(
            model,
            tokenizer_id,
            Addresses.from_env(),
            max_model_len,
            slot,
            grammar_compile_timeout_s,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("tokenizer %s ready", tokenizer_id)
        await service.run(stop)

    uvloop.run(main())
