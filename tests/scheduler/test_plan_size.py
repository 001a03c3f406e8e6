"""Hot-path hygiene: a step plan is a diff, so its size at batch 256 does not grow with context."""

from __future__ import annotations

from stoker.common.ipc import encoder
from stoker.common.messages import StepResult, pack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.services.scheduler.block_manager import BlockManager
from stoker.services.scheduler.request import Request
from stoker.services.scheduler.scheduler import Scheduler, SchedulerConfig

BATCH = 256


def _steady_plan_bytes(prompt_len: int) -> int:
    blocks = BlockManager(num_blocks=BATCH * (prompt_len // 16 + 8), block_size=16)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=1 << 20, max_model_len=8192),
        blocks,
    )
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for i in range(BATCH):
        prompt = [(i * 7 + j) % 1000 + 3 for j in range(prompt_len)]
        sched.add_request(Request(f"req-{i}", prompt, params, 64, eos_token_ids=(2,)))
    sizes = []
    for _ in range(4):  # prefill, then decode steps
        plan = sched.schedule()
        sizes.append(len(encoder.encode(plan)))
        ids = plan_ids(plan)
        sched.update(plan, StepResult(plan.step_id, ids, pack_ids([5] * len(ids))))
    assert sched.num_running == BATCH
    return sizes[-1]


def plan_ids(plan) -> list[str]:
    return [n.req_id for n in plan.new_requests] + plan.running.req_ids


def test_decode_plan_is_small_and_independent_of_context_length():
    short = _steady_plan_bytes(100)
    long = _steady_plan_bytes(2000)
    assert short == long  # a diff: no token ids or block tables of the whole context
    assert long < 16 * 1024, f"{long} bytes for {BATCH} decoding requests"


def test_token_ids_travel_as_one_int32_buffer():
    """Results, token batches and prompts carry ids as a packed array, not a msgpack int list
    (which decodes into one Python object per id)."""
    from stoker.common.ipc import tokenizer_inbound_decoder, worker_outbound_decoder
    from stoker.common.messages import RequestTokens, TokenBatch, unpack_ids

    ids = list(range(1000, 1000 + BATCH))
    raw = pack_ids(ids)
    assert raw == b"".join(i.to_bytes(4, "little") for i in ids)
    wire = encoder.encode(StepResult(7, [f"req-{i}" for i in range(BATCH)], raw))
    assert raw in wire  # the buffer is on the wire as is
    assert unpack_ids(worker_outbound_decoder.decode(wire).token_ids) == ids
    batch = TokenBatch([RequestTokens(f"req-{i}", pack_ids([t])) for i, t in enumerate(ids)])
    decoded = tokenizer_inbound_decoder.decode(encoder.encode(batch))
    assert [unpack_ids(item.token_ids) for item in decoded.items] == [[t] for t in ids]
    assert unpack_ids(pack_ids([])) == []
