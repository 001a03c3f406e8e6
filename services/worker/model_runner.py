"""The worker core: model, paged KV cache and sampler, driven by StepPlans.

It keeps per-request state (token ids, block table, computed count) keyed by request id, so the
scheduler only sends what changed each step. The same class runs in-process (offline engine,
tests) and inside the worker service. Steady decode steps take the fast path in
services/worker/plain_decode.py; every other step takes `execute`'s general path.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from stoker.common.config import EngineConfig
from stoker.common.messages import (
    PromptLogprobs,
    StepPlan,
    StepResult,
    TokenLogprobs,
    pack_ids,
    unpack_ids,
)
from stoker.common.model_config import ModelConfig, resolve_max_model_len
from stoker.common.profiling import span
from stoker.kernels import cpu_ops
from stoker.services.worker.block_table import BlockTable
from stoker.services.worker.cpu_tuning import keep_freed_memory, release_freed_memory
from stoker.services.worker.cuda_graphs import DecodeGraphs, capture_sizes
from stoker.services.worker.drafter import Drafter
from stoker.services.worker.eagle.config import is_eagle_head
from stoker.services.worker.eagle.proposer import EagleProposer, refuse_tensor_parallel
from stoker.services.worker.forward_timer import ForwardTimer
from stoker.services.worker.grammar import Grammars, StepMasks
from stoker.services.worker.greedy_head import GreedyHead
from stoker.services.worker.greedy_head import wanted as greedy_head_wanted
from stoker.services.worker.host_copy import to_device
from stoker.services.worker.kv_sizing import kv_zeros, pool_block_bytes, size_kv_pool
from stoker.services.worker.loader import check_model_folder, load_model, resolve_dtype
from stoker.services.worker.models.layers import CausalLM
from stoker.services.worker.parallel.comm import Communicator
from stoker.services.worker.parallel.shard import local_kv_heads
from stoker.services.worker.plain_decode import execute_plain_decode, steady_states
from stoker.services.worker.prompt_logprobs import (
    null_prompt_logprobs,
    num_prompt_rows,
    prompt_logprobs,
)
from stoker.services.worker.proposer import Proposer
from stoker.services.worker.request_state import RequestState, Scheduled
from stoker.services.worker.sampler import Sampler
from stoker.services.worker.sampling_state import RequestSampling
from stoker.services.worker.step_inputs import (
    Chunk,
    StepInputs,
    build_step_inputs,
    max_decode_chunk,
    sample_ranges,
)
from stoker.services.worker.step_sampling import greedy_outputs, null_outputs, sample_outputs

log = logging.getLogger("stoker.worker")


def load_proposer(
    config: EngineConfig,
    target: CausalLM | None,
    target_cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    comm: Communicator | None,
) -> Proposer | None:
    """The --speculative-model proposer (docs/speculation.md): an EAGLE head where the folder's
    config says so, else a draft model; None without one."""
    if config.speculative != "draft" or config.null_model:
        return None
    folder = config.speculative_model
    assert folder is not None
    args = (config.block_size, dtype, device, max_model_len)
    if is_eagle_head(folder):  # docs/speculation.md, EAGLE
        if comm is not None:
            refuse_tensor_parallel(folder)
        assert target is not None
        return EagleProposer(folder, target, target_cfg, *args, seed=config.seed)
    return Drafter(folder, target_cfg, *args, seed=config.seed)


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
        self.proposer = load_proposer(
            config, self.model, self.model_cfg, self.dtype, self.device, self.max_model_len, comm
        )
        # The last layer outputs only the rows that sample, unless the proposer taps it.
        taps = () if self.proposer is None else self.proposer.tap_layers
        self.trim_last_layer = shapes.num_layers - 1 not in taps
        self._allocate_kv()
        self.sampler = Sampler()
        # Structured outputs' matchers and masks (worker/grammar.py); the tokenizer builds on
        # its own thread now, so the first structured request does not wait for it.
        eos = self.model_cfg.eos_token_ids[0] if self.model_cfg.eos_token_ids else 0
        self.grammars = Grammars(
            folder,
            self.model_cfg.vocab_size,
            eos,
            config.grammar_fast_forward,
            inline=self.device.type == "cpu",
        )
        self.requests: dict[str, RequestState] = {}
        self.block_table = BlockTable(-(-self.max_model_len // self.block_size))
        self.graphs: DecodeGraphs | None = None
        if self._captures():
            self.use_decode_graphs(capture=True)
        if self.device.type == "cpu":
            release_freed_memory()  # the loader's temporaries, kept by keep_freed_memory

    def _captures(self) -> bool:
        """Whether decode steps replay CUDA graphs captured at start-up."""
        config = self.config
        return self.device.type == "cuda" and not config.enforce_eager and self.model is not None

    def _allocate_kv(self) -> None:
        """Size the pool (services/worker/kv_sizing.py), capping max_model_len to it, and map the
        target's and the proposer's caches."""
        config, cfg = self.config, self.model_cfg
        block_bytes = pool_block_bytes(
            cfg, self.block_size, self.kv_heads, self.dtype, self.proposer
        )
        sizes = self._graph_batch_sizes() if self._captures() else []
        pool = size_kv_pool(config, self.model, block_bytes, self.max_model_len, sizes, self.comm)
        self.num_blocks, self.max_model_len = pool.num_blocks, pool.max_model_len
        # One block past the scheduler's pool: the scratch block padded decode rows write to.
        shape = (self.num_blocks + 1, self.block_size, self.kv_heads, cfg.head_dim)
        layers = 0 if config.null_model else cfg.num_layers
        zeros = functools.partial(kv_zeros, dtype=self.dtype, device=self.device)
        self.kv_caches = [(zeros(shape), zeros(shape)) for _ in range(layers)]
        if self.proposer is not None:
            self.proposer.allocate_kv(self.num_blocks, zeros)
        log.info("KV cache: %s", pool.describe())

    def _graph_batch_sizes(self) -> list[int]:
        return capture_sizes(min(self.config.max_num_seqs, self.config.max_cudagraph_capture_size))

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
            if new.params.structured is not None:
                self.grammars.add(new.req_id, new.params.structured.grammar, output)
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
            if state.params.structured is not None:
                self.grammars.drop(req_id)
        if self.proposer is not None:
            self.proposer.drop(req_id)

    def forget_requests(self) -> None:
        """A new scheduler knows none of the old requests, and hands their blocks out afresh."""
        for req_id in list(self.requests):
            self.drop_request(req_id)

    # -- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for req_id in plan.finished_req_ids:
            self.drop_request(req_id)
        states = steady_states(plan, self.requests, self.proposer)
        if states is not None:
            return execute_plain_decode(self, plan, states, t0)
        scheduled = self._apply_plan(plan)
        if not scheduled:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=b"")
        self._propose_drafts(scheduled)
        chunks = [self._chunk(item) for item in scheduled]
        sampled = [item for item, c in zip(scheduled, chunks) if c.num_sampled]
        # Prompt chunks whose requests asked for prompt logprobs: (request, start, rows).
        prompt_wanted = [
            (item.state, c.start, c.num_prompt_rows)
            for item, c in zip(scheduled, chunks)
            if c.num_prompt_rows
        ]
        # Decode-only steps go through the padded CUDA-graph path (services/worker/cuda_graphs.py);
        # prefill, mixed and speculative verify steps run eagerly.
        graphs = None
        if self.graphs is not None and not prompt_wanted and self.graphs.accepts(chunks):
            graphs = self.graphs
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
        masks = self._begin_masks(sampled, ranges, chunks)
        t1 = time.perf_counter()
        logits = greedy_ids = prompt_hidden = None
        if self.model is not None:
            # Eager forwards tap the layers the proposer reads (graph-captured ones do not).
            proposer = self.proposer if inputs is not None else None
            if proposer is not None:
                self.model.tap_layers, self.model.taps = proposer.tap_layers, []
            self.forward_timer.start()
            with span("forward"):
                graph_rows = None
                if graphs is not None and len(sampled) < len(chunks):
                    graph_rows = [i for i, c in enumerate(chunks) if c.num_sampled]
                argmax_only = all(i.state.sampling.argmax_only for i in sampled)
                hidden, prompt_hidden = self.hidden_states(graphs, inputs, graph_rows)
                logits, greedy_ids = self.head(hidden, len(sampled), argmax_only, masks)
                if proposer is not None:
                    self.model.tap_layers = ()
                    chunk_ids = (i.state.req_id for i in scheduled)
                    proposer.record(chunks, chunk_ids, self.model.taps, self.decode_chunk)
                    self.model.taps = []
            self.forward_timer.stop()
        t2 = time.perf_counter()
        with span("sample"):
            if self.model is None:
                outputs = null_outputs(sampled, self.model_cfg.vocab_size, masks, ranges, chunks)
            elif greedy_ids is not None:
                outputs = greedy_outputs(sampled, ranges, chunks, greedy_ids)
            elif not sampled:  # only prompt chunks that do not end their prompts: no logits
                outputs = []
            else:
                assert logits is not None
                if masks is not None:
                    masks.apply(logits)
                outputs = sample_outputs(
                    self.sampler,
                    sampled,
                    logits,
                    ranges,
                    chunks,
                    self.model_cfg.vocab_size,
                    self.device,
                )
            prompt_lps = self._prompt_logprobs(prompt_wanted, prompt_hidden)
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
                if self.proposer is not None:
                    self.proposer.accept(state.req_id, len(state.token_ids), item.k, accepted)
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
        # Structured requests' matchers take their tokens; forced ones are proposed next.
        forced_ids, forced_tokens = [], []
        if masks is not None:
            structured = [
                (item.state.req_id, tokens)
                for item, (tokens, _) in zip(sampled, outputs)
                if item.state.params.structured is not None
            ]
            forced_ids, forced_tokens = self.grammars.advance(structured)
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
            forced_req_ids=forced_ids,
            forced_token_ids=forced_tokens,
            grammar_mask_s=0.0 if masks is None else masks.fill_s,
            grammar_wait_s=0.0 if masks is None else masks.wait_s,
            prompt_logprobs=prompt_lps,
        )

    def _begin_masks(
        self, sampled: list[Scheduled], ranges: list[tuple[int, int]], chunks: list[Chunk]
    ) -> StepMasks | None:
        """Start the structured rows' masks, to fill while the forward runs (worker/grammar.py):
        a verify's rows get the masks after each of its drafts."""
        if not any(item.state.params.structured is not None for item in sampled):
            return None
        firsts = [first for (first, _), c in zip(ranges, chunks) if c.num_sampled]
        rows = [
            (item.state.req_id, first, item.drafts[: item.k] if item.k else [])
            for item, first in zip(sampled, firsts)
            if item.state.params.structured is not None
        ]
        return self.grammars.begin(rows, max(last for _, last in ranges))

    def forward(
        self,
        graphs: DecodeGraphs | None,
        inputs: StepInputs | None,
        graph_rows: list[int] | None,
        num_sampled: int,
        argmax_only: bool,
        masks: StepMasks | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The model over the prepared step (graphs, or eager inputs): (logits of the sampled
        rows, None), or (None, their tokens) where every sampled row wants only the argmax
        (argmax_only) and the greedy head found it, or (None, None) where none sample.
        graph_rows: the graph batch's rows that sample, where not all of them do. masks: the
        step's grammar masks, which the greedy head's tokens obey (logits are returned
        unmasked: the caller applies them)."""
        hidden, _ = self.hidden_states(graphs, inputs, graph_rows)
        return self.head(hidden, num_sampled, argmax_only, masks)

    def hidden_states(
        self,
        graphs: DecodeGraphs | None,
        inputs: StepInputs | None,
        graph_rows: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over the prepared step: the final hidden states of the rows that sample,
        and of the prompt-logprob rows (eager steps with inputs.prompt_rows; else None)."""
        assert self.model is not None
        # Every chunk's K/V must be stored, even in a step where no chunk samples.
        if graphs is not None:
            hidden = graphs.run()
            if graph_rows is not None:
                hidden = hidden[to_device(graph_rows, torch.int64, self.device)]
            return hidden, None
        assert inputs is not None
        last_meta = inputs.last_layer_meta
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, last_meta
        )
        prompt = None
        if inputs.prompt_rows is not None:
            trimmed = last_meta is not None
            prompt = hidden[inputs.last_layer_prompt_rows if trimmed else inputs.prompt_rows]
        rows = inputs.sample_rows if last_meta is None else inputs.last_layer_sample_rows
        return hidden[rows], prompt

    def head(
        self,
        hidden: torch.Tensor,
        num_sampled: int,
        argmax_only: bool,
        masks: StepMasks | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The sampled rows' logits, or their tokens from the greedy head (see `forward`)."""
        assert self.model is not None
        if not num_sampled:
            return None, None
        if self.greedy_head is not None and argmax_only:
            bitmask = None if masks is None else masks.bitmask()
            tokens = self.greedy_head.argmax(hidden, bitmask)
            if tokens is not None:
                return None, tokens
        return self.model.compute_logits(hidden), None

    def _prompt_logprobs(
        self,
        wanted: list[tuple[RequestState, int, int]],
        hidden: torch.Tensor | None,
    ) -> list[PromptLogprobs] | None:
        """The step's prompt-logprob entries (services/worker/prompt_logprobs.py), per chunk."""
        if not wanted:
            return None
        if self.model is None:
            return null_prompt_logprobs(self.model_cfg.vocab_size, wanted)
        assert hidden is not None
        return prompt_logprobs(self.model.compute_logits, hidden, wanted)

    def _propose_drafts(self, scheduled: list[Scheduled]) -> None:
        wanted = [item for item in scheduled if item.k and not item.drafts]
        if not wanted:
            return
        if self.proposer is None:
            raise RuntimeError("the plan asks for draft-model proposals but no draft is loaded")
        proposals = self.proposer.propose(
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
        chunk = Chunk(state.token_ids[start:end], start, state.block_ids, sample, state.table_row)
        if state.params.prompt_logprobs is not None:
            chunk.num_prompt_rows = num_prompt_rows(state, start, end)
        return chunk
