"""The scheduler core (sans-IO): decides which tokens of which requests run in each step.

(Past 400 lines on purpose: the policy reads top to bottom in one class, planning, preemption
and results, as docs/scheduler.md tells it; the steady-decode fast path is apart, in steady.py.)

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

from stoker.common.config import fit_to_pool
from stoker.common.messages import (
    NewRequestData,
    PromptLogprobs,
    RunningRequestData,
    StepPlan,
    StepResult,
    TokenLogprobs,
    pack_ids,
    unpack_ids,
)
from stoker.services.scheduler import steady
from stoker.services.scheduler.block_manager import BlockManager
from stoker.services.scheduler.config import SchedulerConfig
from stoker.services.scheduler.request import (
    NO_VERIFY_IN_FLIGHT,
    NOT_STEADY,
    FinishReason,
    Request,
    RequestStatus,
    RequestUpdate,
)
from stoker.services.scheduler.speculation import SpecPolicy
from stoker.services.scheduler.waiting import WaitingQueue


class Scheduler:
    # The steady-decode fast path (steady.py) in schedule() and update(); off, every request
    # takes the general path (tests/scheduler/test_fast_paths.py compares the two).
    fast_paths = True

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        spec: SpecPolicy | None = None,
    ) -> None:
        # Served engines get the worker's fitted length already; a core driven alone needs it.
        blocks, bs = block_manager.num_blocks, block_manager.block_size
        self.config = dataclasses.replace(
            config, max_model_len=fit_to_pool(config.max_model_len, blocks, bs)
        )
        self.blocks = block_manager
        self.spec = spec
        self._forced: set[str] = set()  # requests with forced tokens (fast-forward) to propose
        self.waiting = WaitingQueue()  # O(1) abort of a waiting request
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # for the next plan: worker drops their state
        self._step_id = 0
        # Spare blocks for decodes (_spare_blocks) this step; whether the last step left a prompt
        # to compute, whose next chunk must not lose its blocks to them.
        self._spares_ok = False
        self._prompt_left = False
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # of those, tokens found
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)
        # Prompt logprobs gathered chunk by chunk, until the request's first update carries them.
        self._prompt_logprobs: dict[str, tuple[Request, list[TokenLogprobs | None]]] = {}

    # -- admission and abort ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"duplicate request id {request.req_id!r}")
        # One comparison in the steady path: plan no token at or past this length.
        request.max_len = min(request.prompt_len + request.max_tokens, self.config.max_model_len)
        self.requests[request.req_id] = request
        self.waiting.append(request)
        if request.params.prompt_logprobs is not None:
            self._prompt_logprobs[request.req_id] = (request, [None])  # token 0 has no entry

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
        """Plan one step (docs/scheduler.md): running requests first, then admissions."""
        self.blocks.begin_step()
        self._spares_ok = (
            not self._prompt_left
            and len(self.running) * DECODE_SPARE_BLOCKS * SPARE_POOL_SHARE <= self.blocks.num_blocks
        )
        self._prompt_left = False
        step = _StepDraft(self.config.max_num_batched_tokens, self.config.prefill_chunk_tokens)
        self._plan_running(step)
        if not step.preempted:
            self._admit_waiting(step)
        drafted = self.spec is not None or any(patch[3] for patch in step.patches)
        steady.fill_running_rows(step.running, step.patches, drafted)
        self._step_id += 1
        plan = StepPlan(
            step_id=self._step_id,
            new_requests=step.new_requests,
            running=step.running,
            finished_req_ids=self._finished_ids,
        )
        self._finished_ids = []
        return plan

    def _plan_running(self, step: _StepDraft) -> None:
        """Running requests, in admission order: each asks for all its uncomputed tokens, capped
        by the budget; one that cannot get blocks preempts the latest admitted."""
        speculate = False
        if self.spec is not None:
            decoding = sum(1 for r in self.running if r.num_output_tokens > 0)
            speculate = self.spec.enabled_for_step(decoding)
        fast = self.fast_paths and not speculate
        ids = step.running.req_ids
        patches = step.patches
        # Steady rows (docs/steady-decode.md) check the budget in bulk: while `slack` (what
        # would be left if every row not yet reached took one token) is >= 0, each fits. Other
        # rows compute the exact budget: one token per row planned so far, plus `extra`.
        budget0, extra = step.budget, 0
        slack = budget0 - len(self.running)
        steady_ok = fast and slack >= 0
        # The running list's own iterator: rows that preemption pops off its end are not reached.
        rows = iter(self.running)
        while True:
            if steady_ok:
                request = steady.next_general_row(rows, ids.append)
            else:
                request = next(rows, None)
            if request is None:
                break
            # (While steady_ok holds, the budget has room for every row left.)
            if not steady_ok and budget0 - len(ids) - extra <= 0:
                self._prompt_left = True  # (a row not reached may be mid-prompt)
                break
            if fast and steady.plan_stop_row(self, request, ids, patches):
                continue
            budget = budget0 - len(ids) - extra
            pending = request.num_planned_tokens - request.num_computed_tokens
            # Prefilling (or recomputing after preemption): a prompt chunk, under the cap.
            prompt_chunk = pending > 1
            if prompt_chunk:
                self._prompt_left = True
            num_tokens = min(pending, budget, step.prefill_left if prompt_chunk else pending)
            drafts: list[int] | int = 0
            if request.spec_inflight != NO_VERIFY_IN_FLIGHT:
                num_tokens = 0  # its token count is unknown until the verify returns
            elif request.forced and num_tokens == 1 and not prompt_chunk:
                if request.num_placeholders:
                    num_tokens = 0  # they follow the token in flight: propose them after it
                else:
                    drafts = self._forced_drafts(request, budget)
                    num_tokens += len(drafts)
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
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted = True
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
            self._plan_row(request, num_tokens, new_blocks, step, drafts)
            extra += num_tokens - 1
            slack -= num_tokens - 1
            steady_ok = fast and slack >= 0
            if prompt_chunk:
                step.prefill_left -= num_tokens
        step.budget = budget0 - len(ids) - extra

    def _admit_waiting(self, step: _StepDraft) -> None:
        """Waiting requests, in arrival order, while budget, seats and blocks above the
        watermark allow; each takes its prefix-cache hits first."""
        now = time.monotonic()
        while (
            self.waiting
            and step.budget > 0
            and step.prefill_left > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            prefix = request.token_ids[:-1]  # always compute at least the last token
            if request.req_id in self._prompt_logprobs:
                prefix = []  # cached blocks have no logits: it computes its whole prompt
            hit = self.blocks.allocate_prefix(request.req_id, prefix)
            if hit is None:
                break  # its prompt's next block is being computed in this step: share it next
            request.num_computed_tokens = hit
            num_tokens = min(request.num_tokens - hit, step.budget, step.prefill_left)
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
            self._plan_row(request, num_tokens, new_blocks, step)
            if request.num_computed_tokens < request.num_tokens:
                self._prompt_left = True
            step.budget -= num_tokens
            step.prefill_left -= num_tokens

    def _key_full_blocks(self, request: Request, known: int) -> None:
        """Key the full blocks among the first `known` tokens, and note the length at which the
        next one fills (a block keyed elsewhere meanwhile only makes that note early)."""
        blocks = self.blocks
        if not blocks.enable_prefix_caching:
            request.next_key_len = _NEVER
            return
        seq = blocks.seqs[request.req_id]
        bs = blocks.block_size
        if known // bs > seq.num_hashed:
            blocks.cache_blocks(request.req_id, request.token_ids, known)
        request.next_key_len = (seq.num_hashed + 1) * bs

    def _drafts(self, request: Request, budget: int) -> list[int] | int:
        """Draft ids (n-gram) or a draft count (draft model), within max_tokens, the context
        length and the step budget: a verify yields at most k + 1 tokens."""
        assert self.spec is not None
        k = min(self.spec.num_drafts(request), self._draft_room(request, budget))
        return self.spec.propose(request, k) if k > 0 else 0

    def _draft_room(self, request: Request, budget: int) -> int:
        """Drafts a verify may carry: it yields up to one token more than its drafts, within
        max_tokens, the context length and the step budget."""
        return min(
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
            budget - 1,
        )

    def _forced_drafts(self, request: Request, budget: int) -> list[int]:
        """The tokens its grammar forces, as drafts (fast-forward), within the same bounds as
        speculation's; the worker verifies them like any draft."""
        drafts = request.forced[: max(self._draft_room(request, budget), 0)]
        self._drop_forced(request)
        request.forced_inflight = bool(drafts)
        return drafts

    def _drop_forced(self, request: Request) -> None:
        request.forced = []
        self._forced.discard(request.req_id)

    def _take_forced(self, result: StepResult) -> None:
        """A result's tokens make earlier forced tokens stale; it brings the new ones."""
        if self._forced:
            for req_id in result.req_ids:
                if req_id in self._forced:
                    self._drop_forced(self.requests[req_id])
        for req_id, packed in zip(result.forced_req_ids, result.forced_token_ids):
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.forced = unpack_ids(packed)
                request.steady_until = NOT_STEADY  # the general path plans its drafts
                self._forced.add(req_id)

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
        want = min(DECODE_SPARE_BLOCKS, -(-(request.max_len - 1) // blocks.block_size) - held)
        if want <= 0:
            return []
        # The room checked above covers them: allocate_slots never comes back short here.
        return blocks.allocate_slots(request.req_id, (held + want) * blocks.block_size) or []

    def _allocate(self, request: Request, num_tokens: int) -> list[int] | None:
        return self.blocks.allocate_slots(request.req_id, request.num_computed_tokens + num_tokens)

    def _plan_row(
        self,
        request: Request,
        num_tokens: int,
        new_blocks: list[int],
        step: _StepDraft,
        drafts: list[int] | int = 0,
    ) -> None:
        """Add a request's row to the plan (in full if the worker holds no state for it) and
        advance its counters; set whether it is steady from here (docs/steady-decode.md)."""
        if request.needs_full_send:
            request.needs_full_send = False
            step.new_requests.append(
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
            ids = step.running.req_ids
            ids.append(request.req_id)
            draft_ids: list[int] | tuple = drafts if isinstance(drafts, list) else ()
            num_spec = num_tokens - 1 if drafts else 0
            if drafts:
                request.spec_inflight = num_tokens - 1
            packed = pack_ids(draft_ids) if draft_ids else b""
            step.patches.append((len(ids) - 1, num_tokens, new_blocks, packed, num_spec))
        # Advance now, not when the result arrives, so the next step can be planned while this
        # one runs (overlap scheduling): a step that reaches the end of the known tokens will
        # sample one, which the next plan already counts on as a placeholder.
        request.num_computed_tokens += num_tokens  # reaching the known end: it samples
        # Key the full blocks of known tokens this step computes, for requests planned later.
        self._key_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        pending = request.num_planned_tokens - request.num_computed_tokens
        if request.spec_inflight == NO_VERIFY_IN_FLIGHT and pending == 1:
            # Steady from here: the fast path may take it until it needs a block or reaches its
            # limit. A block of known tokens waiting for keying (a prompt whose last token, the
            # one still to compute, ends a block) stops it at once.
            held = len(self.blocks.block_table(request.req_id)) * self.blocks.block_size
            request.steady_until = min(held, request.max_len - 1)
            self._stop_at_unkeyed_block(request)
        else:
            request.steady_until = NOT_STEADY

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request.req_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_inflight = NO_VERIFY_IN_FLIGHT
        request.forced_inflight = False
        self._drop_forced(request)
        request.steady_until = NOT_STEADY
        request.next_key_len = 0
        request.num_preemptions += 1
        request.needs_full_send = True
        self.num_preemptions += 1
        self._finished_ids.append(request.req_id)
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._forced.discard(request.req_id)
        self.blocks.free(request.req_id)
        del self.requests[request.req_id]
        if not request.num_output_tokens:  # else its last update carries its prompt logprobs
            self._prompt_logprobs.pop(request.req_id, None)
        if not request.needs_full_send:  # the worker holds state for it
            self._finished_ids.append(request.req_id)

    # -- results --------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Apply a step's sampled tokens; return per-request updates (new tokens, finishes)."""
        token_ids = unpack_ids(result.token_ids)  # one C-level conversion per step
        if result.grammar_mask_s:
            self._share_grammar_time(result)
        if result.prompt_logprobs:
            self._gather_prompt_logprobs(result.prompt_logprobs)
        if self.fast_paths and result.counts is None and result.logprobs is None:
            steady_updates = steady.update_one_token_each(self, plan, result.req_ids, token_ids)
            if self._forced or result.forced_req_ids:
                self._take_forced(result)
            if self._prompt_logprobs:
                self._attach_prompt_logprobs(steady_updates)
            return steady_updates
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
            # (A row that asked has an entry for every token.)
            offset += count
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran: drop the tokens
            update = self._append(request, tokens, logprobs)  # type: ignore[arg-type]
            if update is not None:
                updates.append(update)
        if self._forced or result.forced_req_ids:
            self._take_forced(result)
        if self._prompt_logprobs:
            self._attach_prompt_logprobs(updates)
        return updates

    def _gather_prompt_logprobs(self, chunks: list[PromptLogprobs]) -> None:
        """Add a step's prompt-logprob entries to their requests' lists. A prompt recomputed
        after preemption sends its entries again from the start: they replace the old ones."""
        for chunk in chunks:
            pending = self._prompt_logprobs.get(chunk.req_id)
            if pending is None or pending[0].status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran, as its tokens
            entries = pending[1]
            del entries[chunk.first :]
            entries.extend(chunk.entries)

    def _attach_prompt_logprobs(self, updates: list[RequestUpdate]) -> None:
        """A request's first update carries its prompt logprobs (complete by then: the chunk
        that samples the first token is the prompt's last). It asks no more, so a recompute
        after preemption computes no entries and may take prefix-cache hits."""
        ready = {
            req_id
            for req_id, (request, _) in self._prompt_logprobs.items()
            if request.num_output_tokens
        }
        if not ready:
            return
        for update in updates:
            if update.req_id in ready:
                request, entries = self._prompt_logprobs.pop(update.req_id)
                update.prompt_logprobs = entries
                request.params = msgspec.structs.replace(request.params, prompt_logprobs=None)

    def _share_grammar_time(self, result: StepResult) -> None:
        """The step's grammar-mask time, split evenly over its structured requests (the worker
        fills their masks as one batch): each request's figure for the request log."""
        structured = [
            r
            for r in map(self.requests.get, result.req_ids)
            if r is not None and r.params.structured is not None
        ]
        for request in structured:
            request.grammar_mask_s += result.grammar_mask_s / len(structured)

    def _append(
        self,
        request: Request,
        tokens: list[int],
        logprobs: list[TokenLogprobs] | None,
    ) -> RequestUpdate | None:
        if request.spec_inflight != NO_VERIFY_IN_FLIGHT:
            drafts, accepted = request.spec_inflight, len(tokens) - 1
            request.num_computed_tokens -= drafts - accepted  # rejected positions are not valid
            request.spec_inflight = NO_VERIFY_IN_FLIGHT
            if request.forced_inflight:  # fast-forward's drafts, not speculation's
                request.forced_inflight = False
                request.num_forced_tokens += accepted
            else:
                assert self.spec is not None
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
        if known >= request.next_key_len:
            self._key_full_blocks(request, known)

    def _stop_at_unkeyed_block(self, request: Request) -> None:
        """A full block of known tokens that could not be keyed (its last KV not computed or
        planned yet) ends steady decode now: the next plan's stop row keys it as it plans that
        KV. So steady rows never check for blocks to key."""
        if len(request.token_ids) >= request.next_key_len:
            request.steady_until = min(request.steady_until, request.num_computed_tokens)

    def _cache_computed_blocks(self, plan: StepPlan) -> None:
        ids = [n.req_id for n in plan.new_requests] + plan.running.req_ids
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                computed = min(request.num_computed_tokens, request.num_tokens)
                self.blocks.cache_blocks(req_id, request.token_ids, computed)


_NEVER = 1 << 62  # a next_key_len no context reaches
# Spare blocks a decode takes with each new block when the pool is roomy (_spare_blocks). A stop
# for a block is the steady loop's costliest row (about 1 us warm, several with the
# caches other processes leave cold); 3 spares make it one stop per 4 blocks.
DECODE_SPARE_BLOCKS = 3
# Spares only while running requests x DECODE_SPARE_BLOCKS x this <= the pool's blocks: what
# they hold is at most 1/20 of the pool (room the prefix cache gives up while they are held).
SPARE_POOL_SHARE = 20


def _cut(logprobs: list | None, n: int) -> list | None:
    return None if logprobs is None else logprobs[:n]


class _StepDraft:
    """The plan being built by one schedule(), with what is left of the step's budgets."""

    __slots__ = ("budget", "prefill_left", "new_requests", "running", "patches", "preempted")

    def __init__(self, budget: int, prefill_chunk_tokens: int) -> None:
        self.budget = budget  # tokens; exact only between the two passes (steady rows bulk it)
        self.prefill_left = prefill_chunk_tokens or budget  # prompt-chunk tokens
        self.new_requests: list[NewRequestData] = []
        self.running = RunningRequestData()
        self.patches: list[steady.RowPatch] = []  # the running rows planned off the steady path
        self.preempted = False  # no admission in a step that preempted
