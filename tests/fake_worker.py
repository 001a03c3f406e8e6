"""A fake worker that mirrors the real one's bookkeeping, shared by the scheduler tests.

`FakeWorker` keeps per-request tokens, block tables and computed counts from plans alone (as
`ModelRunner._apply_plan` does), samples when a request's computed tokens reach its known tokens,
and returns tokens that depend only on the context (`target`, unless `force` says otherwise). It
also keeps a fake KV cache (slot -> token) and checks that every position a request attends to
holds that request's token, so bad prefix hits or reused blocks show up. It records every chunk
it ran (`chunks`) and every step that sampled (`sampled`). Outputs can then be compared across
scheduling configurations.

A plain `FakeWorker` refuses verifies; `tests/spec/fakes.py` subclasses it to speculate (see
`_drafts` and `_verify`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

from stoker.common.messages import StepPlan, StepResult, pack_ids, unpack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.services.scheduler.block_manager import BlockManager
from stoker.services.scheduler.request import Request
from stoker.services.scheduler.scheduler import Scheduler, SchedulerConfig
from stoker.services.scheduler.speculation import SpecPolicy

VOCAB = 97
EOS = 0  # never produced by a target unless forced
BS = 4


def next_token(tokens: Sequence[int]) -> int:
    """The plain fake target: a hash of the context, never EOS."""
    return 1 + (sum(tokens[-4:]) * 31 + 7 * len(tokens)) % (VOCAB - 1)


def req(rid: str, prompt: list[int], max_tokens: int = 8, **params: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(rid, prompt, sp, max_tokens, (EOS,))


def make(
    num_blocks: int = 256,
    cache: bool = True,
    reqs: Sequence[Request] = (),
    spec: SpecPolicy | None = None,
    **cfg: int,
) -> Scheduler:
    sched = Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, BS, cache), spec)
    for r in reqs:
        sched.add_request(r)
    return sched


@dataclasses.dataclass
class _State:
    tokens: list[int]
    prompt_len: int
    blocks: list[int]
    computed: int


# One scheduled request of a step: id, state, tokens scheduled, drafts, k, drafts from the plan.
_Item = tuple[str, _State, int, list[int], int, bool]


class FakeWorker:
    def __init__(self, force: dict[str, dict[int, int]] | None = None) -> None:
        self.force = force or {}  # req_id -> {output index: token}
        self.reqs: dict[str, _State] = {}
        self.kv: dict[int, int] = {}  # slot -> the token whose K/V it holds
        self.chunks: defaultdict[str, list[tuple[int, int]]] = defaultdict(list)
        self.sampled: defaultdict[str, list[int]] = defaultdict(list)  # step ids

    @staticmethod
    def target(tokens: Sequence[int]) -> int:
        """The fake target's greedy next token after `tokens`."""
        return next_token(tokens)

    def _next(self, rid: str, st: _State, tokens: Sequence[int]) -> int:
        """The token after `tokens` (a request's context): forced, else the target's."""
        forced = self.force.get(rid, {}).get(len(tokens) - st.prompt_len)
        return self.target(tokens) if forced is None else forced

    def _slot(self, st: _State, pos: int) -> int:
        return st.blocks[pos // BS] * BS + pos % BS

    def _drafts(self, rid: str, st: _State, num: int, ids: list[int], k: int) -> list[int]:
        """The drafts a running request's chunk verifies (k of them), or [] for no verify."""
        assert not k and not ids, ("speculation needs a speculating worker", rid)
        return []

    def _verify(
        self, step_id: int, rid: str, st: _State, drafts: list[int], ngram: bool
    ) -> list[int]:
        """The tokens a verify of `drafts` yields: the accepted drafts and one more."""
        raise AssertionError("speculation needs a speculating worker")

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_req_ids:
            self.reqs.pop(rid, None)
        items: list[_Item] = []
        for new in plan.new_requests:
            assert new.req_id not in self.reqs
            prompt = unpack_ids(new.prompt_token_ids)
            tokens = prompt + unpack_ids(new.output_token_ids)
            st = _State(tokens, len(prompt), list(new.block_ids), 0)
            st.computed = new.num_computed_tokens
            self.reqs[new.req_id] = st
            items.append((new.req_id, st, new.num_scheduled_tokens, [], 0, False))
        run = plan.running
        n = len(run.req_ids)
        spec_ids = run.spec_token_ids or [b""] * n
        num_spec = run.num_spec_tokens or [0] * n
        assert len(spec_ids) == len(num_spec) == n
        for rid, num, new_blocks, ids, k in zip(
            run.req_ids, run.num_scheduled_tokens, run.new_block_ids, spec_ids, num_spec
        ):
            st = self.reqs[rid]
            st.blocks.extend(new_blocks)
            drafts = self._drafts(rid, st, num, unpack_ids(ids), k)
            items.append((rid, st, num, drafts, k, bool(ids)))
        for rid, st, num, drafts, k, _ in items:  # write this step's K/V
            written = [st.tokens[-1], *drafts] if k else st.tokens[st.computed : st.computed + num]
            assert num > 0 and len(written) == num  # never past the known tokens
            assert st.computed + num <= len(st.blocks) * BS
            for i, token in enumerate(written):
                self.kv[self._slot(st, st.computed + i)] = token
            self.chunks[rid].append((plan.step_id, num))
        req_ids: list[str] = []
        token_ids: list[int] = []
        counts: list[int] = []
        for rid, st, num, drafts, k, ngram in items:
            if k:
                out = self._verify(plan.step_id, rid, st, drafts, ngram)
                st.computed += len(out)  # the last token and the accepted drafts
            else:
                st.computed += num
                # A prefill chunk that does not reach the end samples nothing.
                out = [self._next(rid, st, st.tokens)] if st.computed == len(st.tokens) else []
            context = st.tokens + out[:-1]
            for pos in range(st.computed):  # attention reads every computed position
                assert self.kv.get(self._slot(st, pos)) == context[pos], (rid, pos)
            if out:
                st.tokens.extend(out)
                req_ids.append(rid)
                token_ids.extend(out)
                counts.append(len(out))
                self.sampled[rid].append(plan.step_id)
        return StepResult(
            plan.step_id,
            req_ids,
            pack_ids(token_ids),
            counts=counts if len(token_ids) != len(req_ids) else None,
        )


def assert_idle(sched: Scheduler, worker: FakeWorker) -> None:
    assert not sched.has_unfinished() and not sched.requests and not worker.reqs
    sched.blocks.check_invariants()
    assert sched.blocks.num_free_blocks() == sched.blocks.num_blocks
