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

import msgspec

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


class RequestUpdate(msgspec.Struct, gc=False):
    """What one step produced for one request: new token(s), and whether it finished. (A
    struct, not a dataclass: one is made per running request per step, at half the cost.)"""

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
        # Rows of the running section that _emit filled in this schedule() (row, count, new
        # blocks, draft ids, draft count); the rest are steady-decode rows.
        self._row_patches: list[tuple[int, int, list[int], bytes, int]] = []
        self._step_id = 0
        # Spare blocks for decodes (_spare_blocks) this step; whether the last step left a prompt
        # to compute, whose next chunk must not lose its blocks to them.
        self._spares_ok = False
        self._prompt_left = False
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
        self._spares_ok = (
            not self._prompt_left
            and len(self.running) * DECODE_SPARE_BLOCKS * SPARE_POOL_SHARE <= self.blocks.num_blocks
        )
        self._prompt_left = False
        new_requests: list[NewRequestData] = []
        running = RunningRequestData()
        preempted = False
        now = time.monotonic()

        speculate = False
        if self.spec is not None:
            decoding = sum(1 for r in self.running if r.num_output_tokens > 0)
            speculate = self.spec.enabled_for_step(decoding)
        # The steady-decode path below is the hot loop at hundreds of running requests. A request
        # whose num_computed_tokens is below its decode_until decodes one token into a block it
        # already holds, below its limit (set by _emit, cleared by anything that changes that):
        # it costs an id append and two counter bumps. Its count (1) and new blocks (none) are
        # filled in for all such rows at once after the loop.
        running_list = self.running
        blocks, bs = self.blocks, self.blocks.block_size
        add_id = running.req_ids.append
        fast = self.fast_paths and not speculate
        self._row_patches = patches = []
        # The budget is checked in bulk for steady rows: while `slack` (what would be left if
        # every row not yet reached took one token) is >= 0, each of them fits. Other rows
        # compute the exact budget: what the rows emitted so far took, one token each plus
        # `extra`.
        budget0, extra = budget, 0
        slack = budget - len(running_list)
        steady_ok = fast and slack >= 0
        # A for loop over a list that preemption shortens from the end: popped requests are
        # simply not reached.
        for request in running_list:
            computed = request.num_computed_tokens
            if computed < request.decode_until and steady_ok:
                add_id(request.req_id)
                request.num_computed_tokens = computed + 1  # it samples: one placeholder more
                # No block of it is due for keying: a request whose known tokens fill a block
                # it cannot key yet (the last one's KV not planned) stops below instead.
                continue
            if not steady_ok:  # (while it holds, the budget has room for every row left)
                budget = budget0 - len(running.req_ids) - extra
                if budget <= 0:
                    self._prompt_left = True  # (a row not reached may be mid-prompt)
                    break
            if computed == request.decode_until and fast and computed < request.token_limit - 1:
                # Steady decode at a stop: it has filled its blocks (one more, unless the pool
                # is out: then the general path below preempts), or a block of its known tokens
                # waits for keying (done here, as its last KV is planned).
                held = len(blocks.seqs[request.req_id].blocks) * bs
                new_block = blocks.append_block(request.req_id) if computed == held else _NO_BLOCKS
                if new_block is not None:
                    add_id(request.req_id)
                    if new_block:
                        new_block += self._spare_blocks(request)
                        held += bs * len(new_block)
                        patches.append((len(running.req_ids) - 1, 1, new_block, b"", 0))
                    request.num_computed_tokens = computed + 1
                    limit = request.token_limit - 1
                    request.decode_until = held if held < limit else limit
                    if len(request.token_ids) >= request.hash_at_len:
                        self._key_blocks(request, len(request.token_ids))
                    continue
            budget = budget0 - len(running.req_ids) - extra
            pending = request.num_planned_tokens - request.num_computed_tokens
            # Prefilling (or recomputing after preemption): a prompt chunk, under the cap.
            prompt_chunk = pending > 1
            if prompt_chunk:
                self._prompt_left = True
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
                slack += 1  # its token is free for the rows behind it
                continue
            new_blocks = self._allocate(request, num_tokens)
            while new_blocks is None:
                victim = running_list.pop()
                self._preempt(victim)
                preempted = True
                self._spares_ok = False  # blocks are short: none to spare this step
                slack += 1  # a row not reached, or this one
                if victim is request:
                    break
                new_blocks = self._allocate(request, num_tokens)
            if new_blocks is None:
                break
            if new_blocks and num_tokens == 1:
                new_blocks += self._spare_blocks(request)
            # A running request has been sent in full: its row joins the running section.
            self._emit(request, num_tokens, new_blocks, new_requests, running, drafts)
            extra += num_tokens - 1
            slack -= num_tokens - 1
            steady_ok = fast and slack >= 0
            if prompt_chunk:
                prefill_left -= num_tokens

        budget = budget0 - len(running.req_ids) - extra
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
            if request.num_computed_tokens < request.num_tokens:
                self._prompt_left = True
            budget -= num_tokens
            prefill_left -= num_tokens

        self._fill_running_rows(running, patches)
        self._step_id += 1
        plan = StepPlan(
            step_id=self._step_id,
            new_requests=new_requests,
            running=running,
            finished_req_ids=self._finished_ids,
        )
        self._finished_ids = []
        return plan

    def _fill_running_rows(self, running: RunningRequestData, patches: list[tuple]) -> None:
        """The per-row lists of the running section: steady-decode rows take 1 token and no new
        block (one shared, read-only empty list); rows from _emit take what they recorded."""
        n = len(running.req_ids)
        counts = [1] * n
        new_blocks: list[list[int]] = [_NO_BLOCKS] * n
        for row, num_tokens, blocks, _, _ in patches:
            counts[row] = num_tokens
            new_blocks[row] = blocks
        running.num_scheduled_tokens = counts
        running.new_block_ids = new_blocks
        if self.spec is not None:
            spec_ids: list[bytes] = [b""] * n
            num_spec = [0] * n
            for row, _, _, ids, k in patches:
                spec_ids[row] = ids
                num_spec[row] = k
            running.spec_token_ids = spec_ids
            running.num_spec_tokens = num_spec

    def _key_blocks(self, request: Request, known: int) -> None:
        """Key the full blocks among the first `known` tokens, and note the length at which the
        next one fills (a block keyed elsewhere meanwhile only makes that note early)."""
        blocks = self.blocks
        if not blocks.enable_prefix_caching:
            request.hash_at_len = _NEVER
            return
        seq = blocks.seqs[request.req_id]
        bs = blocks.block_size
        if known // bs > seq.num_hashed:
            blocks.cache_blocks(request.req_id, request.token_ids, known)
        request.hash_at_len = (seq.num_hashed + 1) * bs

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

    def _spare_blocks(self, request: Request) -> list[int]:
        """A row that computes one token and has just taken a new block also takes up to
        DECODE_SPARE_BLOCKS more, so steady decode stops for blocks once every few blocks rather
        than at each. They are taken like any block (a free one, else the least recently used
        cached one) and freed with the request, unkeyed if never filled; never past what its
        token limit can fill. Only while they cost little:
        - the prefix cache: spares held (at most DECODE_SPARE_BLOCKS per running request) stay
          within 1/SPARE_POOL_SHARE of the pool, so the cache loses at most that much room;
        - preemption: room for every running request to take as many above the admission
          watermark, no preemption in this step, and no prompt left to compute after the last
          step (its next chunk must not find its blocks gone).
        """
        if not self._spares_ok:
            return []
        blocks = self.blocks
        room = len(self.running) * (DECODE_SPARE_BLOCKS + 1) + self._watermark_blocks
        if blocks.num_free_blocks() < room:
            return []
        held = len(blocks.seqs[request.req_id].blocks)
        want = min(DECODE_SPARE_BLOCKS, -(-(request.token_limit - 1) // blocks.block_size) - held)
        if want <= 0:
            return []
        # The room checked above covers them: allocate_slots never comes back short here.
        return blocks.allocate_slots(request.req_id, (held + want) * blocks.block_size) or []

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
            ids: list[int] | tuple = drafts if isinstance(drafts, list) else ()
            num_spec = num_tokens - 1 if drafts else 0
            if drafts:
                request.spec_inflight = num_tokens - 1
            packed = pack_ids(ids) if ids else b""
            self._row_patches.append(
                (len(running.req_ids) - 1, num_tokens, new_blocks, packed, num_spec)
            )
        # Advance now, not when the result arrives, so the next step can be planned while this
        # one runs (overlap scheduling): a step that reaches the end of the known tokens will
        # sample one, which the next plan already counts on as a placeholder.
        request.num_computed_tokens += num_tokens  # reaching the known end: it samples
        # Key the full blocks of known tokens this step computes, for requests planned later.
        self._key_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        pending = request.num_planned_tokens - request.num_computed_tokens
        if request.spec_inflight < 0 and pending == 1:
            # Steady decode from here: the fast path may take it until it needs a block or
            # reaches its limit. A block of known tokens waiting for keying (a prompt whose last
            # token, the one still to compute, ends a block) stops it at once.
            held = len(self.blocks.block_table(request.req_id)) * self.blocks.block_size
            request.decode_until = min(held, request.token_limit - 1)
            self._stop_at_unkeyed_block(request)
        else:
            request.decode_until = -1

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request.req_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_inflight = -1
        request.decode_until = -1
        request.hash_at_len = 0
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
            self._cache_computed_blocks(plan)  # the loop below keys only the rows with one
        updates: list[RequestUpdate] = []
        add_update = updates.append
        requests = self.requests
        max_len = self.config.max_model_len
        running_status = RequestStatus.RUNNING
        for req_id, token in zip(req_ids, token_ids):
            request = requests.get(req_id)
            if request is None or request.status is not running_status:
                continue  # aborted or preempted while the step ran: drop the token
            if request.spec_inflight >= 0:
                update = self._append(request, [token], None)
                if update is not None:
                    add_update(update)
                continue
            ids = request.token_ids
            ids.append(token)
            n = len(ids)
            # Key a block as soon as its last token is known and its KV computed or planned
            # (with overlap, the step in flight computes the token just appended), and before
            # a finish frees the blocks (once a block: the test keeps the calls off the loop).
            if n >= request.hash_at_len:
                self._key_known(request)
                self._stop_at_unkeyed_block(request)
            # token_limit is min(prompt + max_tokens, max_model_len): one test for both lengths.
            if token in request.stop_ids or n >= request.token_limit:
                reason = request.check_stop(max_len)
                assert reason is not None
                self.running.remove(request)
                self._finish(request, reason)
                add_update(RequestUpdate(req_id, [token], request, reason))
            else:
                add_update(RequestUpdate(req_id, [token], request))
        return updates

    def _append(
        self,
        request: Request,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None] | None,
    ) -> RequestUpdate | None:
        if request.spec_inflight >= 0:
            assert self.spec is not None
            drafts, accepted = request.spec_inflight, len(tokens) - 1
            request.num_computed_tokens -= drafts - accepted  # rejected positions are not valid
            request.spec_inflight = -1
            self.spec.on_result(request, drafts, accepted)
        max_len = self.config.max_model_len
        reason = None
        for i, token in enumerate(tokens):
            request.token_ids.append(token)
            reason = request.check_stop(max_len)
            if reason is not None:
                tokens, logprobs = tokens[: i + 1], _cut(logprobs, i + 1)
                break
        self._key_known(request)  # before a finish frees the blocks
        self._stop_at_unkeyed_block(request)
        if reason is not None:
            self.running.remove(request)
            self._finish(request, reason)
        return RequestUpdate(request.req_id, tokens, request, reason, logprobs)

    def _key_known(self, request: Request) -> None:
        """Key the full blocks of known tokens whose KV is computed or planned."""
        known = min(request.num_computed_tokens, len(request.token_ids))
        if known >= request.hash_at_len:
            self._key_blocks(request, known)

    def _stop_at_unkeyed_block(self, request: Request) -> None:
        """A full block of known tokens that could not be keyed (its last KV not computed or
        planned yet) ends steady decode now: the next plan's stop row keys it as it plans that
        KV. So steady-decode rows never check for blocks to key."""
        if len(request.token_ids) >= request.hash_at_len:
            request.decode_until = min(request.decode_until, request.num_computed_tokens)

    def _cache_computed_blocks(self, plan: StepPlan) -> None:
        ids = [n.req_id for n in plan.new_requests] + plan.running.req_ids
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                computed = min(request.num_computed_tokens, request.num_tokens)
                self.blocks.cache_blocks(req_id, request.token_ids, computed)


_NEVER = 1 << 62  # a hash_at_len no context reaches
# Spare blocks a decode takes with each new block when the pool is roomy (_spare_blocks). A stop
# for a block is the steady-decode loop's costliest row (about 1 us warm, several with the
# caches other processes leave cold); 3 spares make it one stop per 4 blocks.
DECODE_SPARE_BLOCKS = 3
# Spares only while running requests x DECODE_SPARE_BLOCKS x this <= the pool's blocks: what
# they hold is at most 1/20 of the pool (room the prefix cache gives up while they are held).
SPARE_POOL_SHARE = 20
_NO_BLOCKS: list[int] = []  # shared by every steady-decode row of every plan: never mutated


def _cut(logprobs: list | None, n: int) -> list | None:
    return None if logprobs is None else logprobs[:n]
