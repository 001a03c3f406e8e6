"""The scheduler core (sans-IO): decides which tokens of which requests run in each step.

Policy, in the style of vLLM V1 (no separate prefill and decode phases):
- Each step has a token budget (`max_num_batched_tokens`) and a request cap (`max_num_seqs`).
- Running requests go first, in arrival order: each asks for all its uncomputed tokens (1 when
  decoding; the rest of its prompt when prefilling), capped by the remaining budget. So long
  prompts are chunked and chunks share a step with decodes.
- If a running request cannot get KV blocks, the most recently admitted running request is
  preempted (its blocks freed, recomputed later) until it fits. Preempted requests return to the
  front of the queue; their freed blocks stay in the prefix cache, so resuming mostly hits the
  cache instead of recomputing. No new request is admitted in a step that preempted, and new
  requests are admitted only while a small watermark of blocks stays free: this stops thrashing.
- Waiting requests are admitted in order while budget, seats and blocks allow, taking their
  prefix-cache hits first. Blocks join the prefix cache when the step computing them is
  planned, so a request whose prompt continues into blocks this very step computes (the n
  choices of one request) waits one step and then takes them as hits: the prompt is computed
  once.
"""

from __future__ import annotations

import dataclasses
import time

from common.messages import (
    NewRequestData,
    RunningRequestData,
    StepPlan,
    StepResult,
    TokenLogprobs,
    pack_ids,
    unpack_ids,
)
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import FinishReason, Request, RequestStatus
from services.scheduler.speculation import SpecPolicy
from services.scheduler.waiting import WaitingQueue


@dataclasses.dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Prompt-chunk tokens per step (requests computing more than one token, a prompt or a
    # recompute after preemption); decodes and verifies are not counted. 0: only
    # max_num_batched_tokens caps them. Small chunks let each prompt of a wave start decoding
    # as soon as its own chunk is done instead of when the wave's is.
    prefill_chunk_tokens: int = 0
    max_model_len: int = 2048
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests


@dataclasses.dataclass
class RequestUpdate:
    """What one step produced for one request: new token(s), and whether it finished."""

    req_id: str
    new_token_ids: list[int]
    request: Request
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs | None] | None = None


class Scheduler:
    # The steady-decode fast paths of schedule() and update(); off, every request takes the
    # general path (tests compare the two plan for plan).
    fast_paths = True

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        spec: SpecPolicy | None = None,
    ) -> None:
        # A lone request must always fit in the pool, or preempting everyone else could never
        # make room for it: cap the context length at the pool's capacity.
        capacity = block_manager.num_blocks * block_manager.block_size
        self.config = dataclasses.replace(config, max_model_len=min(config.max_model_len, capacity))
        self.blocks = block_manager
        self.spec = spec
        self.waiting = WaitingQueue()  # O(1) abort of a waiting request
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # for the next plan: worker drops their state
        self._step_id = 0
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # of those, tokens found
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)

    # -- admission and abort ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"duplicate request id {request.req_id!r}")
        # One comparison in the steady-decode path: plan no token at or past this length.
        limit = min(request.prompt_len + request.max_tokens, self.config.max_model_len)
        request.token_limit = limit
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def abort(self, req_id: str) -> bool:
        """Drop a request wherever it is. Unknown or finished ids are ignored."""
        request = self.requests.get(req_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- planning -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        prefill_left = self.config.prefill_chunk_tokens or budget
        self.blocks.begin_step()
        new_requests: list[NewRequestData] = []
        running = RunningRequestData()
        preempted = False
        now = time.monotonic()

        speculate = False
        if self.spec is not None:
            decoding = sum(1 for r in self.running if r.num_output_tokens > 0)
            speculate = self.spec.enabled_for_step(decoding)
        # The steady-decode path below is the hot loop at hundreds of running requests: it
        # inlines what the general path would compute for a request that decodes one token
        # into a block it already holds, and calls out only when something changes.
        blocks, seqs, bs = self.blocks, self.blocks.seqs, self.blocks.block_size
        with_spec = self.spec is not None
        add_id = running.req_ids.append
        add_count = running.num_scheduled_tokens.append
        add_blocks = running.new_block_ids.append
        running_list = self.running
        fast = self.fast_paths and not speculate
        # A for loop over a list that preemption shortens from the end: popped requests are
        # simply not reached.
        for request in running_list:
            if budget <= 0:
                break
            token_ids = request.token_ids
            computed = request.num_computed_tokens
            planned = len(token_ids) + request.num_placeholders
            if (
                fast
                and planned - computed == 1
                and planned < request.token_limit
                and request.spec_inflight < 0
                and not request.needs_full_send
            ):
                seq = seqs[request.req_id]
                if computed < len(seq.blocks) * bs:  # the next slot is in a held block
                    add_id(request.req_id)
                    add_count(1)
                    add_blocks([])
                    if with_spec:
                        running.spec_token_ids.append(b"")
                        running.num_spec_tokens.append(0)
                    request.num_computed_tokens = computed + 1
                    request.num_placeholders += 1  # it samples
                    known = computed + 1 if computed < len(token_ids) else len(token_ids)
                    if known // bs > seq.num_hashed:  # a block of known tokens just filled
                        blocks.cache_blocks(request.req_id, token_ids, known)
                    budget -= 1
                    continue
            pending = request.num_planned_tokens - request.num_computed_tokens
            # Prefilling (or recomputing after preemption): a prompt chunk, under the cap.
            prompt_chunk = pending > 1
            num_tokens = min(pending, budget, prefill_left if prompt_chunk else pending)
            drafts: list[int] | int = 0
            if request.spec_inflight >= 0:
                num_tokens = 0  # its token count is unknown until the verify returns
            elif speculate and num_tokens == 1 and not prompt_chunk and request.num_output_tokens:
                if request.num_placeholders:
                    num_tokens = 0  # speculate from real tokens once the step in flight returns
                else:
                    drafts = self._drafts(request, budget)
                    num_tokens += drafts if isinstance(drafts, int) else len(drafts)
            if num_tokens <= 0 or request.is_done_after_inflight(self.config.max_model_len):
                continue
            new_blocks = self._allocate(request, num_tokens)
            while new_blocks is None:
                victim = running_list.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = self._allocate(request, num_tokens)
            if new_blocks is None:
                break
            self._emit(request, num_tokens, new_blocks, new_requests, running, drafts)
            budget -= num_tokens
            if prompt_chunk:
                prefill_left -= num_tokens

        while (
            self.waiting
            and budget > 0
            and prefill_left > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            prefix = request.token_ids[:-1]  # always compute at least the last token
            hit = self.blocks.allocate_prefix(request.req_id, prefix)
            if hit is None:
                break  # its prompt's next block is being computed in this step: share it next
            request.num_computed_tokens = hit
            num_tokens = min(request.num_tokens - hit, budget, prefill_left)
            new_blocks = None
            if self._fits_above_watermark(request, hit + num_tokens):
                new_blocks = self._allocate(request, num_tokens)
            if new_blocks is None:
                # A queued request must hold no blocks, or waiting requests could starve the pool.
                self.blocks.free(request.req_id)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            # Counted on admission only: a failed attempt is retried next step and must not
            # count twice.
            self.prefix_queries += len(prefix)
            self.prefix_hits += hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            self._emit(request, num_tokens, new_blocks, new_requests, running)
            budget -= num_tokens
            prefill_left -= num_tokens

        self._step_id += 1
        plan = StepPlan(
            step_id=self._step_id,
            new_requests=new_requests,
            running=running,
            finished_req_ids=self._finished_ids,
        )
        self._finished_ids = []
        return plan

    def _drafts(self, request: Request, budget: int) -> list[int] | int:
        """Draft ids (n-gram) or a draft count (draft model), within max_tokens, the context
        length and the step budget: a verify yields at most k + 1 tokens."""
        assert self.spec is not None
        room = min(
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
            budget - 1,
        )
        k = min(self.spec.num_drafts(request), room)
        return self.spec.propose(request, k) if k > 0 else 0

    def _fits_above_watermark(self, request: Request, total_tokens: int) -> bool:
        if not self.running:  # an idle engine always admits, whatever the watermark
            return True
        held = len(self.blocks.block_table(request.req_id))
        needed = -(-total_tokens // self.blocks.block_size) - held
        return self.blocks.num_free_blocks() - needed >= self._watermark_blocks

    def _allocate(self, request: Request, num_tokens: int) -> list[int] | None:
        return self.blocks.allocate_slots(request.req_id, request.num_computed_tokens + num_tokens)

    def _emit(
        self,
        request: Request,
        num_tokens: int,
        new_blocks: list[int],
        new_requests: list[NewRequestData],
        running: RunningRequestData,
        drafts: list[int] | int = 0,
    ) -> None:
        if request.needs_full_send:
            request.needs_full_send = False
            new_requests.append(
                NewRequestData(
                    req_id=request.req_id,
                    prompt_token_ids=pack_ids(request.prompt_token_ids),
                    output_token_ids=pack_ids(request.output_token_ids),
                    params=request.params,
                    block_ids=list(self.blocks.block_table(request.req_id)),
                    num_computed_tokens=request.num_computed_tokens,
                    num_scheduled_tokens=num_tokens,
                )
            )
        else:
            running.req_ids.append(request.req_id)
            running.num_scheduled_tokens.append(num_tokens)
            running.new_block_ids.append(new_blocks)
            if self.spec is not None:
                ids = drafts if isinstance(drafts, list) else ()
                running.spec_token_ids.append(pack_ids(ids))
                running.num_spec_tokens.append(num_tokens - 1 if drafts else 0)
                if drafts:
                    request.spec_inflight = num_tokens - 1
        # Advance now, not when the result arrives, so the next step can be planned while this
        # one runs (overlap scheduling): a step that reaches the end of the known tokens will
        # sample one, which the next plan already counts on as a placeholder.
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens >= request.num_planned_tokens:  # samples (or verifies)
            request.num_placeholders += 1
        # Key the full blocks of known tokens this step computes, for requests planned later.
        computed = min(request.num_computed_tokens, request.num_tokens)
        self.blocks.cache_blocks(request.req_id, request.token_ids, computed)

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request.req_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_placeholders = 0
        request.spec_inflight = -1
        request.num_preemptions += 1
        request.needs_full_send = True
        self.num_preemptions += 1
        self._finished_ids.append(request.req_id)
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.blocks.free(request.req_id)
        del self.requests[request.req_id]
        if not request.needs_full_send:  # the worker holds state for it
            self._finished_ids.append(request.req_id)

    # -- results --------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Apply a step's sampled tokens; return per-request updates (new tokens, finishes)."""
        token_ids = unpack_ids(result.token_ids)  # one C-level conversion per step
        if self.fast_paths and result.counts is None and result.logprobs is None:
            return self._update_one_token_each(plan, result.req_ids, token_ids)
        # Cache first: a request that finishes below frees its blocks, and the blocks it filled
        # in its last step must already be in the prefix cache by then.
        self._cache_computed_blocks(plan)
        updates: list[RequestUpdate] = []
        counts = result.counts
        offset = 0
        for row, req_id in enumerate(result.req_ids):
            count = 1 if counts is None else counts[row]
            tokens = token_ids[offset : offset + count]
            logprobs = None if result.logprobs is None else result.logprobs[offset : offset + count]
            if logprobs is not None and logprobs[0] is None:
                logprobs = None  # another request in the step asked; this one did not
            offset += count
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran: drop the tokens
            update = self._append(request, tokens, logprobs)
            if update is not None:
                updates.append(update)
        return updates

    def _update_one_token_each(
        self, plan: StepPlan, req_ids: list[str], token_ids: list[int]
    ) -> list[RequestUpdate]:
        """update() for a step where every row sampled one token and none asked for logprobs:
        the general path with its per-request calls inlined."""
        if len(req_ids) != plan.num_requests:  # some rows computed a prompt chunk, no token
            self._cache_computed_blocks(plan)
            cache_each = False
        else:
            cache_each = True  # the rows are the plan's requests: key blocks in the same loop
        updates: list[RequestUpdate] = []
        requests, seqs, blocks = self.requests, self.blocks.seqs, self.blocks
        bs, max_len = blocks.block_size, self.config.max_model_len
        running_status = RequestStatus.RUNNING
        for req_id, token in zip(req_ids, token_ids):
            request = requests.get(req_id)
            if request is None or request.status is not running_status:
                continue  # aborted or preempted while the step ran: drop the token
            ids = request.token_ids
            if cache_each:  # as _cache_computed_blocks, before a finish frees the blocks
                known = request.num_computed_tokens
                if known > len(ids):
                    known = len(ids)
                if known // bs > seqs[req_id].num_hashed:
                    blocks.cache_blocks(req_id, ids, known)
            if request.spec_inflight >= 0:
                update = self._append(request, [token], None)
                if update is not None:
                    updates.append(update)
                continue
            request.num_placeholders -= 1
            ids.append(token)
            if (
                token in request.stop_ids
                or len(ids) - request.prompt_len >= request.max_tokens
                or len(ids) >= max_len
            ):
                reason = request.check_stop(max_len)
                assert reason is not None
                self.running.remove(request)
                self._finish(request, reason)
                updates.append(RequestUpdate(req_id, [token], request, reason, None))
            else:
                updates.append(RequestUpdate(req_id, [token], request, None, None))
        return updates

    def _append(
        self,
        request: Request,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None] | None,
    ) -> RequestUpdate | None:
        request.num_placeholders -= 1
        if request.spec_inflight >= 0:
            assert self.spec is not None
            drafts, accepted = request.spec_inflight, len(tokens) - 1
            request.num_computed_tokens -= drafts - accepted  # rejected positions are not valid
            request.spec_inflight = -1
            self.spec.on_result(request, drafts, accepted)
        max_len = self.config.max_model_len
        for i, token in enumerate(tokens):
            request.token_ids.append(token)
            reason = request.check_stop(max_len)
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
                return RequestUpdate(
                    request.req_id, tokens[: i + 1], request, reason, _cut(logprobs, i + 1)
                )
        return RequestUpdate(request.req_id, tokens, request, None, logprobs)

    def _cache_computed_blocks(self, plan: StepPlan) -> None:
        ids = [n.req_id for n in plan.new_requests] + plan.running.req_ids
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                computed = min(request.num_computed_tokens, request.num_tokens)
                self.blocks.cache_blocks(req_id, request.token_ids, computed)


def _cut(logprobs: list | None, n: int) -> list | None:
    return None if logprobs is None else logprobs[:n]
