"""The worker core: model, paged KV cache and sampler, driven by StepPlans.

It keeps per-request state (token ids, block table, computed count) keyed by request id, so the
scheduler only sends what changed each step. The same class runs in-process (offline engine,
tests) and inside the worker service.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TypeVar

import numpy as np
import torch

from common.config import EngineConfig
from common.messages import StepPlan, StepResult, TokenLogprobs, pack_ids, unpack_ids
from common.model_config import ModelConfig, resolve_max_model_len
from common.profiling import span
from common.sampling_params import SamplingParams
from kernels import cpu_ops
from services.worker.block_table import BlockTable
from services.worker.cpu_tuning import keep_freed_memory, release_freed_memory, resident_zeros
from services.worker.cuda_graphs import DecodeGraphs, capture_sizes
from services.worker.drafter import Drafter
from services.worker.eagle.config import is_eagle_head
from services.worker.eagle.proposer import EagleProposer, refuse_tensor_parallel
from services.worker.forward_timer import ForwardTimer
from services.worker.greedy_head import GreedyHead
from services.worker.greedy_head import wanted as greedy_head_wanted
from services.worker.host_copy import host_list, to_device
from services.worker.kv_sizing import (
    GIB,
    check_cpu_pool_fits,
    cpu_kv_blocks,
    gpu_kv_blocks,
    kv_block_bytes,
    memory_available_bytes,
    profile_gpu_memory,
)
from services.worker.loader import check_model_folder, load_model, resolve_dtype
from services.worker.parallel.comm import Communicator
from services.worker.parallel.shard import local_kv_heads
from services.worker.sampler import Sampler, token_logprobs
from services.worker.sampling_state import RequestSampling, Row, batch_for
from services.worker.spec_verify import VerifyGroup, accept_equal, verify
from services.worker.step_inputs import (
    Chunk,
    StepInputs,
    build_decode_inputs,
    build_step_inputs,
    max_decode_chunk,
    sample_ranges,
)

log = logging.getLogger("stoker.worker")
IdsT = TypeVar("IdsT", int, np.ndarray)


def null_next_token(last: IdsT, vocab_size: int) -> IdsT:
    """The null model's next token after `last` (an id, or an array of them): fixed and cheap,
    so the host pipeline runs without a forward."""
    return (last * 7 + 1) % vocab_size


@dataclasses.dataclass(slots=True)
class Scheduled:
    """A request's share of this step: num_tokens to compute, or a verify of k drafts."""

    state: RequestState
    num_tokens: int
    drafts: list[int] = dataclasses.field(default_factory=list)
    k: int = 0  # drafts to verify (from the scheduler's n-gram ids or the draft model)
    draft_probs: torch.Tensor | None = None


@dataclasses.dataclass(slots=True)
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + sampled outputs
    prompt_len: int
    params: SamplingParams
    block_ids: list[int]
    num_computed: int  # tokens whose K/V are in the cache
    sampling: RequestSampling  # penalty counts and logit_bias on the device
    table_row: int = -1  # its row in the runner's BlockTable (a mirror of block_ids)


class ModelRunner:
    def __init__(self, config: EngineConfig, comm: Communicator | None = None) -> None:
        """comm: this rank's communicator under tensor parallelism (services/worker/parallel/):
        the model and the KV pool are then this rank's shard; None is the one-rank path."""
        self.config = config
        self.comm = comm
        folder = check_model_folder(config.model)
        self.model_cfg = ModelConfig.from_folder(folder)
        self.kv_heads = self.model_cfg.num_kv_heads
        if comm is not None:
            self.kv_heads = local_kv_heads(self.kv_heads, comm.world_size)
        self.device = torch.device(config.device)
        self.forward_timer = ForwardTimer(self.device)
        self.dtype = resolve_dtype(config.dtype, self.model_cfg, config.device)
        self.max_model_len = resolve_max_model_len(self.model_cfg, config.max_model_len)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            keep_freed_memory()
            cpu_ops.load()  # build or load the native kernels now, not in the first step
        self.model = None
        if not config.null_model:
            self.model = load_model(folder, self.dtype, config.device, self.max_model_len, comm)
        self.greedy_head: GreedyHead | None = None
        if self.model is not None and greedy_head_wanted(self.model, self.device, self.dtype):
            self.greedy_head = GreedyHead(self.model.lm_head_weight())
        # The model's own (per-rank under tensor parallelism) head counts pick the decode path.
        shapes = self.model_cfg if self.model is None else self.model.cfg
        self.decode_chunk = max_decode_chunk(self.device, self.dtype, shapes)
        self.drafter: Drafter | EagleProposer | None = None
        self.eagle: EagleProposer | None = None  # the drafter, when it is an EAGLE head
        if config.speculative == "draft" and not config.null_model:
            assert config.speculative_model is not None
            args = (self.block_size, self.dtype, self.device, self.max_model_len)
            if is_eagle_head(config.speculative_model):  # docs/speculation.md, EAGLE
                if comm is not None:
                    refuse_tensor_parallel(config.speculative_model)
                assert self.model is not None
                self.drafter = self.eagle = EagleProposer(
                    config.speculative_model, self.model, self.model_cfg, *args, seed=config.seed
                )
            else:
                self.drafter = Drafter(
                    config.speculative_model, self.model_cfg, *args, seed=config.seed
                )
        # The last layer outputs only the rows that sample, unless an EAGLE head reads it.
        last_layer = shapes.num_layers - 1
        self.trim_last_layer = self.eagle is None or last_layer not in self.eagle.tap_layers
        capture = self.device.type == "cuda" and not config.enforce_eager and self.model is not None
        if config.num_kv_blocks:
            self.num_blocks, source = config.num_kv_blocks, "--num-kv-blocks"
        else:
            self.num_blocks, source = self._blocks_that_fit(capture)
        if comm is not None:  # each rank sized its own pool: the scheduler gets one number
            self.num_blocks = comm.min_int(self.num_blocks)
        if self.device.type == "cpu" and not config.null_model:
            pool_bytes = (self.num_blocks + 1) * self._block_bytes()
            check_cpu_pool_fits(pool_bytes, memory_available_bytes(), source)
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            # A lone request must always fit in the pool, or preemption could never make room.
            log.warning(
                "KV cache holds %d tokens; capping max_model_len %d to it",
                capacity,
                self.max_model_len,
            )
            self.max_model_len = capacity
        cfg = self.model_cfg
        # One block past the scheduler's pool: the scratch block padded decode rows write to.
        shape = (self.num_blocks + 1, self.block_size, self.kv_heads, cfg.head_dim)
        layers = 0 if config.null_model else cfg.num_layers
        self.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(layers)]
        if self.drafter is not None:
            self.drafter.allocate_kv(self.num_blocks, self._zeros)
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, from %s); max_model_len %d",
            self.num_blocks,
            self.block_size,
            capacity,
            self.num_blocks * self._block_bytes() / GIB,
            source,
            self.max_model_len,
        )
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.block_table = BlockTable(-(-self.max_model_len // self.block_size))
        self.graphs: DecodeGraphs | None = None
        if capture:
            self.use_decode_graphs(capture=True)
        if self.device.type == "cpu":
            release_freed_memory()  # the loader's temporaries, kept by keep_freed_memory

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Zeroed KV memory, mapped at start-up (`resident_zeros`). Zeros (not garbage) matter:
        masked-out slots must not hold NaNs that 0 * NaN would spread."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = math.prod(shape) * torch.tensor([], dtype=self.dtype).element_size()
        return resident_zeros(nbytes).view(self.dtype).view(shape)

    def _block_bytes(self) -> int:
        cfg = self.model_cfg
        elem = torch.tensor([], dtype=self.dtype).element_size()
        # The null model sizes its (unallocated) pool as the real model would, so the scheduler
        # sees the same number of blocks.
        size = kv_block_bytes(cfg.num_layers, self.block_size, self.kv_heads, cfg.head_dim, elem)
        if self.drafter is not None:  # its cache has as many blocks as the target's
            size += self.drafter.kv_block_bytes(elem)
        return size

    def _graph_batch_sizes(self) -> list[int]:
        return capture_sizes(min(self.config.max_num_seqs, self.config.max_cudagraph_capture_size))

    def _blocks_that_fit(self, capture: bool) -> tuple[int, str]:
        """(blocks, where the number came from), leaving room for the scratch block."""
        block_bytes = self._block_bytes()
        if self.device.type != "cuda":
            blocks = cpu_kv_blocks(self.config.kv_cache_memory_gb, block_bytes) - 1
            return max(1, blocks), f"--kv-cache-memory-gb {self.config.kv_cache_memory_gb}"
        profile = profile_gpu_memory(
            self.model,
            device=self.device,
            block_size=self.block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            graph_batch_sizes=self._graph_batch_sizes() if capture else [],
        )
        utilization = self.config.gpu_memory_utilization
        blocks = gpu_kv_blocks(profile, utilization, block_bytes) - 1
        return max(1, blocks), profile.describe(utilization)

    def use_decode_graphs(self, capture: bool = True) -> None:
        """Serve decode-only steps through DecodeGraphs (services/worker/cuda_graphs.py), padded
        to captured batch sizes. capture=False: the same padded persistent-buffer path with an
        eager forward instead of a replay; CPU tests use it, since capture needs CUDA."""
        if self.model is None:
            raise ValueError("the null model has no forward to capture")
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            max_batch=self._graph_batch_sizes()[-1],
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            scratch_block=self.num_blocks,
            device=self.device,
            capture=capture,
        )

    # -- plan bookkeeping ---------------------------------------------------------------------

    def _apply_plan(self, plan: StepPlan) -> list[Scheduled]:
        """The step's requests, new ones registered and running ones given their new blocks
        (finished ones are dropped before, by execute)."""
        scheduled: list[Scheduled] = []
        for new in plan.new_requests:
            prompt = unpack_ids(new.prompt_token_ids)
            output = unpack_ids(new.output_token_ids)
            state = RequestState(
                req_id=new.req_id,
                token_ids=prompt + output,
                prompt_len=len(prompt),
                params=new.params,
                block_ids=list(new.block_ids),
                num_computed=new.num_computed_tokens,
                sampling=RequestSampling(
                    new.params, prompt, output, self.model_cfg.vocab_size, self.device
                ),
            )
            old = self.requests.get(new.req_id)
            if old is not None:  # resent without a finish: the new state replaces it
                self.block_table.release(old.table_row)
            state.table_row = self.block_table.add(state.block_ids)
            self.requests[new.req_id] = state
            scheduled.append(Scheduled(state, new.num_scheduled_tokens))
        running = plan.running
        spec_ids = running.spec_token_ids or [b""] * len(running.req_ids)
        num_spec = running.num_spec_tokens or [0] * len(running.req_ids)
        for req_id, num_tokens, new_blocks, drafts, k in zip(
            running.req_ids, running.num_scheduled_tokens, running.new_block_ids, spec_ids, num_spec
        ):
            state = self.requests[req_id]
            if new_blocks:
                state.block_ids.extend(new_blocks)
                self.block_table.append(state.table_row, new_blocks)
            scheduled.append(Scheduled(state, num_tokens, unpack_ids(drafts) if drafts else [], k))
        return scheduled

    def drop_request(self, req_id: str) -> None:
        """Forget a finished, aborted or preempted request (unknown ids are ignored)."""
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table.release(state.table_row)
        if self.drafter is not None:
            self.drafter.drop(req_id)

    # -- the plain decode step -----------------------------------------------------------------

    def _plain_decode_states(self, plan: StepPlan) -> list[RequestState] | None:
        """The running requests' states where this step only decodes one token for each: no new
        requests, no drafts, each at the end of its known tokens. That is nearly every step at
        high concurrency, and `_execute_plain_decode` runs it on arrays; None: any other step,
        which takes the general path. Reads state, changes none."""
        running = plan.running
        req_ids = running.req_ids
        if (
            plan.new_requests
            or not req_ids
            or any(running.spec_token_ids)  # [b"", ...] when speculation is on but idle
            or any(running.num_spec_tokens)
            or self.eagle is not None  # it records every eager forward's chunks
            or running.num_scheduled_tokens.count(1) != len(req_ids)
        ):
            return None
        requests = self.requests
        states = [requests[r] for r in req_ids]
        if any(len(s.token_ids) != s.num_computed + 1 for s in states):
            return None  # a one-token prompt chunk, which samples nothing
        return states

    def _execute_plain_decode(
        self, plan: StepPlan, states: list[RequestState], t0: float
    ) -> StepResult:
        """execute() for a plain decode step: the same result as the general path, from
        per-request arrays instead of Scheduled and Chunk objects (tests/worker/
        test_plain_decode.py compares the two step for step)."""
        running, table = plan.running, self.block_table
        for i, blocks in enumerate(running.new_block_ids):
            if blocks:
                state = states[i]
                state.block_ids.extend(blocks)
                table.append(state.table_row, blocks)
        n = len(states)
        ids = np.fromiter((s.token_ids[-1] for s in states), np.int64, n)
        positions = np.fromiter((s.num_computed for s in states), np.int64, n)
        rows = np.fromiter((s.table_row for s in states), np.int64, n)
        t1 = time.perf_counter()
        logits = greedy_ids = None
        if self.model is not None:
            graphs = self.graphs
            widths = table.widths(rows)
            if graphs is not None and not graphs.accepts_rows(widths):
                graphs = None
            inputs = None
            if graphs is not None:
                graphs.prepare_rows(ids, positions, table.table[rows, : graphs.width])
            else:
                tables = table.table[rows, : int(widths.max())]
                inputs = build_decode_inputs(ids, positions, tables, self.block_size, self.device)
            argmax_only = all(s.sampling.argmax_only for s in states)
            self.forward_timer.start()
            with span("forward"):
                logits, greedy_ids = self._forward(graphs, inputs, None, n, argmax_only)
            self.forward_timer.stop()
        t2 = time.perf_counter()
        logprobs: list[TokenLogprobs | None] | None = None
        with span("sample"):
            if self.model is None:
                tokens = null_next_token(ids, self.model_cfg.vocab_size).tolist()
            elif greedy_ids is not None:
                tokens = host_list(greedy_ids)
            else:
                assert logits is not None
                rows_ = [Row(s.sampling, len(s.token_ids) - s.prompt_len) for s in states]
                batch = batch_for(rows_, self.model_cfg.vocab_size, self.device)
                tokens = host_list(self.sampler(logits, batch).token_ids)
                if any(s.params.logprobs is not None for s in states):
                    lists = [[t] for t in tokens]
                    per_request = self._logprobs(states, list(range(n)), lists, logits)
                    logprobs = [None if lp is None else lp[0] for lp in per_request]
        for state, token in zip(states, tokens):
            state.num_computed += 1
            state.token_ids.append(token)
            if state.sampling.counts is not None:
                state.sampling.add((token,))
        t3 = time.perf_counter()
        forward_host_s = t2 - t1
        forward_s = 0.0 if self.model is None else self.forward_timer.device_seconds(forward_host_s)
        return StepResult(
            step_id=plan.step_id,
            req_ids=running.req_ids,
            token_ids=pack_ids(tokens),
            logprobs=logprobs,
            prepare_s=t1 - t0,
            forward_s=forward_s,
            sample_s=t3 - t2,
            forward_host_s=forward_host_s,
            num_tokens=n,
            num_reqs=n,
        )

    # -- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for req_id in plan.finished_req_ids:
            self.drop_request(req_id)
        states = self._plain_decode_states(plan)
        if states is not None:
            return self._execute_plain_decode(plan, states, t0)
        scheduled = self._apply_plan(plan)
        if not scheduled:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=b"")
        self._propose_drafts(scheduled)
        chunks = [self._chunk(item) for item in scheduled]
        sampled = [item for item, c in zip(scheduled, chunks) if c.num_sampled]
        # Decode-only steps go through the padded CUDA-graph path (services/worker/cuda_graphs.py);
        # prefill, mixed and speculative verify steps run eagerly.
        graphs = self.graphs if self.graphs is not None and self.graphs.accepts(chunks) else None
        if graphs is not None:
            graphs.prepare(chunks)
            ranges = sample_ranges(chunks)
            inputs = None
        else:
            inputs = build_step_inputs(
                chunks,
                self.block_size,
                self.device,
                self.decode_chunk,
                self.block_table.table,
                trim_last_layer=self.trim_last_layer,
            )
            ranges = inputs.sample_ranges
        t1 = time.perf_counter()
        logits = greedy_ids = None
        if self.model is not None:
            # Eager forwards tap the layers an EAGLE head reads (graph-captured ones do not).
            eagle = self.eagle if inputs is not None else None
            if eagle is not None:
                self.model.tap_layers, self.model.taps = eagle.tap_layers, []
            self.forward_timer.start()
            with span("forward"):
                graph_rows = None
                if graphs is not None and len(sampled) < len(chunks):
                    graph_rows = [i for i, c in enumerate(chunks) if c.num_sampled]
                argmax_only = all(i.state.sampling.argmax_only for i in sampled)
                logits, greedy_ids = self._forward(
                    graphs, inputs, graph_rows, len(sampled), argmax_only
                )
                if eagle is not None:
                    self.model.tap_layers = ()
                    req_ids = [i.state.req_id for i in scheduled]
                    eagle.record(chunks, req_ids, self.model.taps, self.decode_chunk)
                    self.model.taps = []
            self.forward_timer.stop()
        t2 = time.perf_counter()
        with span("sample"):
            if greedy_ids is not None:
                outputs = self._greedy_outputs(sampled, ranges, chunks, greedy_ids)
            else:
                outputs = self._sample(sampled, logits, ranges, chunks)
        for item in scheduled:
            if item.k:
                continue  # advanced below by what was accepted
            item.state.num_computed += item.num_tokens
        req_ids, token_ids, counts = [], [], []
        logprobs: list[TokenLogprobs | None] = []  # filled only once some request has them
        for item, (tokens, lps) in zip(sampled, outputs):
            state = item.state
            if item.k:
                accepted = len(tokens) - 1
                if self.drafter is not None:
                    self.drafter.accept(state.req_id, len(state.token_ids), item.k, accepted)
                state.num_computed += 1 + accepted
            state.token_ids.extend(tokens)
            state.sampling.add(tokens)
            req_ids.append(state.req_id)
            token_ids.extend(tokens)
            counts.append(len(tokens))
            if lps is not None:
                if not logprobs:  # the rows before this one had none
                    logprobs = [None] * (len(token_ids) - len(tokens))
                logprobs.extend(lps)
            elif logprobs:
                logprobs.extend([None] * len(tokens))
        t3 = time.perf_counter()
        forward_host_s = t2 - t1
        forward_s = 0.0 if self.model is None else self.forward_timer.device_seconds(forward_host_s)
        return StepResult(
            step_id=plan.step_id,
            req_ids=req_ids,
            token_ids=pack_ids(token_ids),
            counts=counts if len(token_ids) != len(req_ids) else None,
            logprobs=logprobs or None,
            prepare_s=t1 - t0,
            forward_s=forward_s,
            sample_s=t3 - t2,
            forward_host_s=forward_host_s,
            num_tokens=sum(len(c.token_ids) for c in chunks),
            num_reqs=len(chunks),
        )

    def _forward(
        self,
        graphs: DecodeGraphs | None,
        inputs: StepInputs | None,
        graph_rows: list[int] | None,
        num_sampled: int,
        argmax_only: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The model over the prepared step (graphs, or eager inputs): (logits of the sampled
        rows, None), or (None, their tokens) where every sampled row wants only the argmax
        (argmax_only) and the greedy head found it, or (None, None) where none sample.
        graph_rows: the graph batch's rows that sample, where not all of them do."""
        assert self.model is not None
        # Every chunk's K/V must be stored, even in a step where no chunk samples.
        if graphs is not None:
            hidden = graphs.run()
            if graph_rows is not None:
                hidden = hidden[to_device(graph_rows, torch.int64, self.device)]
        else:
            assert inputs is not None
            last_meta = inputs.last_layer_meta
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, last_meta
            )
            rows = inputs.sample_rows if last_meta is None else inputs.last_layer_sample_rows
            hidden = hidden[rows]
        if not num_sampled:
            return None, None
        if self.greedy_head is not None and argmax_only:
            tokens = self.greedy_head.argmax(hidden)
            if tokens is not None:
                return None, tokens
        return self.model.compute_logits(hidden), None

    def _propose_drafts(self, scheduled: list[Scheduled]) -> None:
        wanted = [item for item in scheduled if item.k and not item.drafts]
        if not wanted:
            return
        if self.drafter is None:
            raise RuntimeError("the plan asks for draft-model proposals but no draft is loaded")
        proposals = self.drafter.propose(
            [
                (
                    i.state.req_id,
                    i.state.token_ids,
                    i.state.block_ids,
                    i.state.params,
                    i.k,
                    len(i.state.token_ids) - i.state.prompt_len,
                )
                for i in wanted
            ]
        )
        for item, (drafts, dist) in zip(wanted, proposals):
            item.drafts, item.draft_probs = drafts, dist

    def _chunk(self, item: Scheduled) -> Chunk:
        state = item.state
        start = state.num_computed
        if item.k:  # verify: the last known token, then the drafts; logits at every position
            tokens = [state.token_ids[-1], *item.drafts]
            return Chunk(tokens, start, state.block_ids, item.k + 1, state.table_row)
        end = start + item.num_tokens
        sample = 1 if end == len(state.token_ids) else 0
        return Chunk(state.token_ids[start:end], start, state.block_ids, sample, state.table_row)

    def _sample(self, sampled, logits, ranges, chunks):
        """Per sampled request: (new tokens, their logprobs or None). ranges: per chunk, its
        rows in the logits."""
        if not sampled:
            return []
        if self.model is None:
            vocab = self.model_cfg.vocab_size
            return [([null_next_token(i.state.token_ids[-1], vocab)], None) for i in sampled]
        ranges = [r for r, c in zip(ranges, chunks) if c.num_sampled]
        rows: list[Row] = []
        groups: list[VerifyGroup] = []
        for item, (first, last) in zip(sampled, ranges):
            state = item.state
            num_output = len(state.token_ids) - state.prompt_len
            for j in range(last - first):  # verify rows see the drafts before them as output
                rows.append(Row(state.sampling, num_output + j, item.drafts[:j]))
            if item.k:
                groups.append(
                    VerifyGroup(
                        first,
                        item.drafts,
                        item.draft_probs,
                        state.params.greedy,
                        state.params.seed,
                        num_output,
                    )
                )
        batch = batch_for(rows, self.model_cfg.vocab_size, self.device)
        if not groups:
            tokens = [[t] for t in host_list(self.sampler(logits, batch).token_ids)]
        else:
            verified = iter(verify(logits, batch, groups, self.sampler.generator))
            plain = (
                host_list(self.sampler(logits, batch).token_ids)
                if len(groups) < len(sampled)
                else []
            )
            tokens = [
                next(verified) if item.k else [plain[first]]
                for item, (first, _) in zip(sampled, ranges)
            ]
        states = [item.state for item in sampled]
        firsts = [first for first, _ in ranges]
        return list(zip(tokens, self._logprobs(states, firsts, tokens, logits)))

    def _greedy_outputs(self, sampled, ranges, chunks, greedy_ids):
        """_sample's result from the greedy head's tokens: a plain row's token, or a verify's
        drafts up to the first that differs from the target's argmax, then that argmax."""
        ids = host_list(greedy_ids)
        ranges = [r for r, c in zip(ranges, chunks) if c.num_sampled]
        return [
            (accept_equal(item.drafts, ids[first:last]) if item.k else [ids[first]], None)
            for item, (first, last) in zip(sampled, ranges)
        ]

    def _logprobs(
        self,
        states: list[RequestState],
        firsts: list[int],
        tokens: list[list[int]],
        logits: torch.Tensor,
    ) -> list[list[TokenLogprobs] | None]:
        """Per request, its tokens' logprobs if it asked: one pass over the rows that asked.
        firsts: each request's first row in the logits."""
        asked = [i for i, state in enumerate(states) if state.params.logprobs is not None]
        out: list[list[TokenLogprobs] | None] = [None] * len(states)
        if not asked:
            return out
        rows, ids, top_n = [], [], []
        for i in asked:
            first = firsts[i]
            rows.extend(range(first, first + len(tokens[i])))
            ids.extend(tokens[i])
            top_n.extend([states[i].params.logprobs] * len(tokens[i]))
        flat = iter(token_logprobs(logits, rows, ids, top_n))
        for i in asked:
            out[i] = [next(flat) for _ in tokens[i]]
        return out
