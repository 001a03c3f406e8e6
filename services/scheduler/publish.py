"""What the scheduler process tells others: each step's tokens, as one TokenBatch per owning
tokenizer, and the SchedulerStats the api serves (/metrics, /health)."""

from __future__ import annotations

import time

import msgspec

from stoker.common.messages import RequestTokens, SchedulerStats, StepResult, TokenBatch, pack_ids
from stoker.common.telemetry import BusyTracker, IdleGapAccounting, StepTelemetry
from stoker.common.wire_digest import PROTOCOL
from stoker.services.scheduler.block_manager import BlockManager
from stoker.services.scheduler.request import RequestUpdate
from stoker.services.scheduler.scheduler import Scheduler


class Owner:
    __slots__ = ("routing_id", "announced")

    def __init__(self, routing_id: bytes) -> None:
        self.routing_id = routing_id
        self.announced = False  # the first RequestTokens carries prompt/cache/queue figures


def token_batches(
    updates: list[RequestUpdate], owners: dict[str, Owner]
) -> dict[bytes, TokenBatch]:
    """One step's updates as a batch per owning tokenizer: steady rows (one token of an
    announced request that goes on, nothing else to say) as columns, every other row as an
    item. A finished request leaves `owners`; updates for requests it lacks are dropped."""
    batches: dict[bytes, TokenBatch] = {}
    steady_tokens: dict[bytes, list[int]] = {}
    for update in updates:
        owner = owners.get(update.req_id)
        if owner is None:
            continue
        routing_id = owner.routing_id
        batch = batches.get(routing_id)
        if batch is None:
            batch = batches[routing_id] = TokenBatch([])
            steady_tokens[routing_id] = []
        request = update.request
        tokens = update.new_token_ids
        if (
            update.finish_reason is None
            and owner.announced
            and len(tokens) == 1
            and update.logprobs is None
            and not request.num_draft_tokens
        ):
            batch.steady_req_ids.append(update.req_id)
            steady_tokens[routing_id].append(tokens[0])
            continue
        reason = update.finish_reason.value if update.finish_reason else None
        item = RequestTokens(update.req_id, pack_ids(tokens), reason, update.logprobs)
        if not owner.announced:  # (so a first update, the one with prompt logprobs, is an item)
            owner.announced = True
            item.prompt_logprobs = update.prompt_logprobs
            item.num_prompt_tokens = request.prompt_len
            item.num_cached_tokens = max(request.num_cached_tokens, 0)
            if request.first_scheduled_time is not None:
                item.queue_s = request.first_scheduled_time - request.arrival_time
        if request.num_draft_tokens:  # per request, for the token-ID request log
            item.num_draft_tokens = request.num_draft_tokens
            item.num_accepted_tokens = request.num_accepted_tokens
        if reason is not None:
            item.grammar_mask_s = request.grammar_mask_s
            item.num_forced_tokens = request.num_forced_tokens
            del owners[update.req_id]
        batch.items.append(item)
    for routing_id, tokens in steady_tokens.items():
        if tokens:
            batches[routing_id].steady_token_ids = pack_ids(tokens)
    return batches


class StepStats:
    """The step timings and busy fraction SchedulerStats carries (docs/observability.md)."""

    def __init__(self) -> None:
        self.telemetry = StepTelemetry.empty()
        self.busy = BusyTracker()
        self.idle_gaps = IdleGapAccounting()

    def record(self, result: StepResult, update_s: float) -> None:
        t = self.telemetry
        t.num_steps += 1
        t.observe("update", update_s)
        t.observe("plan_ipc", max(0.0, result.plan_ipc_s))
        t.observe("result_ipc", max(0.0, time.time() - result.sent_at))
        t.observe("worker_prepare", result.prepare_s)
        t.observe("worker_forward", result.forward_s)
        t.observe("worker_forward_host", result.forward_host_s)
        t.observe("worker_sample", result.sample_s)
        t.observe("worker_idle", self.idle_gaps.gap(result.step_id, result.idle_s))
        if result.grammar_mask_s:
            t.observe("grammar_mask", result.grammar_mask_s)
            t.observe("grammar_wait", result.grammar_wait_s)
        if result.num_reqs:
            t.observe_batch(result.num_tokens, result.num_reqs)
        self.busy.add(result.prepare_s + result.forward_host_s + result.sample_s)

    def snapshot(
        self,
        scheduler: Scheduler,
        blocks: BlockManager,
        worker_ready: bool,
        max_model_len: int,
        model_name: str,
    ) -> SchedulerStats:
        return SchedulerStats(
            worker_ready=worker_ready,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_free_blocks=blocks.num_free_blocks(),
            num_total_blocks=blocks.num_blocks,
            kv_usage=blocks.usage(),
            prefix_queries=scheduler.prefix_queries,
            prefix_hits=scheduler.prefix_hits,
            num_preemptions=scheduler.num_preemptions,
            max_model_len=max_model_len,
            model_name=model_name,
            telemetry=msgspec.structs.replace(self.telemetry, busy_fraction=self.busy.fraction()),
            spec=scheduler.spec.stats if scheduler.spec is not None else None,
            protocol=PROTOCOL,
        )
