"""The scheduler's steady-decode fast path (docs/steady-decode.md).

A steady row is a running request that decodes one token into a KV block it already holds,
below its length limit, with no verify in flight and no block of known tokens waiting to be
keyed. `Request.steady_until` marks it: while `num_computed_tokens < steady_until` the request is
steady, and planning it costs an id append and a counter bump. At hundreds of running requests
nearly every row of a step is steady, so this is the scheduler's hot loop.

Here live its four pieces, beside the general path in scheduler.py:
- `next_general_row` walks the running list, planning steady rows inline, and hands the policy
  the first row that is not steady;
- `plan_stop_row` plans a row at its stop (`num_computed_tokens == steady_until`): it takes
  the next block (with spares) or keys a full block, and the row stays steady;
- `fill_running_rows` fills the plan's per-row columns once, after the loop;
- `update_one_token_each` is update() for a step where every row sampled one token.

`Scheduler.fast_paths = False` sends every row through the general path; tests/scheduler/
test_fast_paths.py checks the two give the same plans and outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from stoker.common.messages import RunningRequestData, StepPlan
from stoker.services.scheduler.request import (
    NO_VERIFY_IN_FLIGHT,
    Request,
    RequestStatus,
    RequestUpdate,
)

if TYPE_CHECKING:
    from stoker.services.scheduler.scheduler import Scheduler

# A row of the running section planned off the steady path: (row, token count, new blocks,
# packed draft ids, draft count). Steady rows take 1 token and no new block.
RowPatch = tuple[int, int, list[int], bytes, int]
NO_BLOCKS: list[int] = []  # shared by every steady row of every plan: never mutated


def next_general_row(rows: Iterator[Request], add_id: Callable[[str], None]) -> Request | None:
    """Plan steady rows from `rows` until one is not steady; return it (None at the end).

    The caller has checked that the step's budget holds one token for every row left. The
    iterator is the running list's own, so rows that preemption pops off its end are never
    reached, by this loop or the caller's."""
    for request in rows:
        computed = request.num_computed_tokens
        if computed < request.steady_until:
            add_id(request.req_id)
            request.num_computed_tokens = computed + 1  # it samples: one placeholder more
            continue
        return request
    return None


def plan_stop_row(
    sched: Scheduler, request: Request, ids: list[str], patches: list[RowPatch]
) -> bool:
    """Plan a steady row at its stop, if it can stay steady; False sends it to the general path
    (its limit is near, or the pool is out of blocks and someone must be preempted).

    A row stops when it has filled its blocks (it takes one more, plus spares) or when a block
    of its known tokens waits for keying (keyed here, as its last KV is planned)."""
    computed = request.num_computed_tokens
    if computed != request.steady_until or computed >= request.max_len - 1:
        return False
    blocks, bs = sched.blocks, sched.blocks.block_size
    held = len(blocks.seqs[request.req_id].blocks) * bs
    new_block = blocks.append_block(request.req_id) if computed == held else NO_BLOCKS
    if new_block is None:
        return False
    ids.append(request.req_id)
    if new_block:
        new_block += sched._spare_blocks(request)
        held += bs * len(new_block)
        patches.append((len(ids) - 1, 1, new_block, b"", 0))
    request.num_computed_tokens = computed + 1
    limit = request.max_len - 1
    request.steady_until = held if held < limit else limit
    if len(request.token_ids) >= request.next_key_len:
        sched._key_full_blocks(request, len(request.token_ids))
    return True


def fill_running_rows(running: RunningRequestData, patches: list[RowPatch], spec: bool) -> None:
    """The per-row lists of the running section: steady rows take 1 token and no new block (one
    shared, read-only empty list); the other rows take what their patches recorded."""
    n = len(running.req_ids)
    counts = [1] * n
    new_blocks: list[list[int]] = [NO_BLOCKS] * n
    for row, num_tokens, blocks, _, _ in patches:
        counts[row] = num_tokens
        new_blocks[row] = blocks
    running.num_scheduled_tokens = counts
    running.new_block_ids = new_blocks
    if spec:
        spec_ids: list[bytes] = [b""] * n
        num_spec = [0] * n
        for row, _, _, draft_ids, k in patches:
            spec_ids[row] = draft_ids
            num_spec[row] = k
        running.spec_token_ids = spec_ids
        running.num_spec_tokens = num_spec


def update_one_token_each(
    sched: Scheduler, plan: StepPlan, req_ids: list[str], token_ids: list[int]
) -> list[RequestUpdate]:
    """update() for a step where every row sampled one token and none asked for logprobs: the
    general path (Scheduler._append) with its per-request calls inlined for steady rows."""
    if len(req_ids) != plan.num_requests:  # some rows computed a prompt chunk, no token
        sched._cache_computed_blocks(plan)  # the loop below keys only the rows with one
    updates: list[RequestUpdate] = []
    add_update = updates.append
    requests = sched.requests
    max_model_len = sched.config.max_model_len
    running_status = RequestStatus.RUNNING
    no_verify = NO_VERIFY_IN_FLIGHT  # a local: a global lookup per row costs ~3 us at 256
    for req_id, token in zip(req_ids, token_ids):
        request = requests.get(req_id)
        if request is None or request.status is not running_status:
            continue  # aborted or preempted while the step ran: drop the token
        if request.spec_inflight != no_verify:
            update = sched._append(request, [token], None)
            if update is not None:
                add_update(update)
            continue
        ids = request.token_ids
        ids.append(token)
        n = len(ids)
        # Key a block as soon as its last token is known and its KV computed or planned (with
        # overlap, the step in flight computes the token just appended), and before a finish
        # frees the blocks (once a block: the test keeps the calls off the loop).
        if n >= request.next_key_len:
            sched._key_known(request)
            sched._stop_at_unkeyed_block(request)
        # max_len is min(prompt + max_tokens, max_model_len): one test for both lengths.
        if token in request.stop_ids or n >= request.max_len:
            reason = request.check_stop(max_model_len)
            assert reason is not None
            sched.running.remove(request)
            sched._finish(request, reason)
            add_update(RequestUpdate(req_id, [token], request, reason))
        else:
            add_update(RequestUpdate(req_id, [token], request))
    return updates
