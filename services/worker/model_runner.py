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

import numpy as np
import torch

from common.config import EngineConfig
from common.messages import StepPlan, StepResult, TokenLogprobs
from common.sampling_params import SamplingParams
from services.worker.attention_metadata import AttentionMetadata, PrefillSpan
from services.worker.loader import check_model_folder, load_model, resolve_dtype
from services.worker.model_config import ModelConfig
from services.worker.sampler import Sampler, SamplingBatch

log = logging.getLogger("stoker.worker")


@dataclasses.dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + sampled outputs
    prompt_len: int
    params: SamplingParams
    block_ids: list[int]
    num_computed: int  # tokens whose K/V are in the cache


def resolve_max_model_len(config: EngineConfig, model_cfg: ModelConfig) -> int:
    limit = model_cfg.max_position_embeddings
    if model_cfg.sliding_window:  # no sliding-window attention: stay inside one window
        limit = min(limit, model_cfg.sliding_window)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        folder = check_model_folder(config.model)
        self.model_cfg = ModelConfig.from_folder(folder)
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_cfg, config.device)
        self.max_model_len = resolve_max_model_len(config, self.model_cfg)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = None
        if not config.null_model:
            self.model = load_model(folder, self.dtype, config.device, self.max_model_len)
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
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
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        layers = 0 if config.null_model else cfg.num_layers
        self.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(layers)]
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Zeroed KV memory. On CPU it comes from calloc via numpy, so pages are mapped lazily and
        resident memory grows with the blocks actually used rather than the whole pool. Zeros
        (not garbage) matter: masked-out slots must not hold NaNs that 0 * NaN would spread."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = math.prod(shape) * torch.tensor([], dtype=self.dtype).element_size()
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(self.dtype).view(shape)

    def _blocks_that_fit(self) -> int:
        cfg = self.model_cfg
        elem = torch.tensor([], dtype=self.dtype).element_size()
        block_bytes = 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.gpu_memory_utilization
        else:
            budget = self.config.kv_cache_memory_gb * 1024**3
        return max(1, int(budget // block_bytes))

    # -- plan bookkeeping ---------------------------------------------------------------------

    def _apply_plan(self, plan: StepPlan) -> list[tuple[RequestState, int]]:
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        scheduled: list[tuple[RequestState, int]] = []
        for new in plan.new_requests:
            state = RequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                prompt_len=len(new.prompt_token_ids),
                params=new.params,
                block_ids=list(new.block_ids),
                num_computed=new.num_computed_tokens,
            )
            self.requests[new.req_id] = state
            scheduled.append((state, new.num_scheduled_tokens))
        running = plan.running
        for req_id, num_tokens, new_blocks in zip(
            running.req_ids, running.num_scheduled_tokens, running.new_block_ids
        ):
            state = self.requests[req_id]
            if new_blocks:
                state.block_ids.extend(new_blocks)
            scheduled.append((state, num_tokens))
        return scheduled

    # -- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        scheduled = self._apply_plan(plan)
        if not scheduled:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=[])
        input_ids, positions, meta, sample_rows, sample_states = self._prepare(scheduled)
        t1 = time.perf_counter()
        logits = None
        if self.model is not None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[sample_rows]) if sample_states else None
        t2 = time.perf_counter()
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] | None = None
        if self.model is None:  # null model: a fixed, cheap next token
            vocab = self.model_cfg.vocab_size
            token_ids = [(s.token_ids[-1] * 7 + 1) % vocab for s in sample_states]
        elif logits is not None:
            batch = SamplingBatch.build(
                [s.params for s in sample_states],
                [s.token_ids[: s.prompt_len] for s in sample_states],
                [s.token_ids[s.prompt_len :] for s in sample_states],
                self.model_cfg.vocab_size,
                self.device,
            )
            out = self.sampler(logits, batch)
            token_ids = out.token_ids.tolist()
            if out.logprobs is not None:
                logprobs = _collect_logprobs(sample_states, out)
        for state, num_tokens in scheduled:
            state.num_computed += num_tokens
        for state, token in zip(sample_states, token_ids):
            state.token_ids.append(token)
        t3 = time.perf_counter()
        return StepResult(
            step_id=plan.step_id,
            req_ids=[s.req_id for s in sample_states],
            token_ids=token_ids,
            logprobs=logprobs,
            prepare_s=t1 - t0,
            forward_s=t2 - t1,
            sample_s=t3 - t2,
        )

    def _prepare(self, scheduled: list[tuple[RequestState, int]]):
        """Flatten the step's tokens decode-first and build the attention metadata."""
        bs = self.block_size
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n != 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_states: list[RequestState] = []
        for state, _ in decodes:
            pos = state.num_computed
            input_ids.append(state.token_ids[pos])
            positions.append(pos)
            slots.append(state.block_ids[pos // bs] * bs + pos % bs)
            if pos + 1 == len(state.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_states.append(state)
        decode_tables = decode_lens = None
        if decodes:
            max_blocks = max(len(s.block_ids) for s, _ in decodes)
            table = np.zeros((len(decodes), max_blocks), dtype=np.int64)
            for row, (state, _) in enumerate(decodes):
                table[row, : len(state.block_ids)] = state.block_ids
            decode_tables = torch.from_numpy(table).to(self.device)
            decode_lens = torch.tensor([s.num_computed + 1 for s, _ in decodes], device=self.device)
        spans: list[PrefillSpan] = []
        for state, num_tokens in prefills:
            start_pos = state.num_computed
            end_pos = start_pos + num_tokens
            start_row = len(input_ids)
            input_ids.extend(state.token_ids[start_pos:end_pos])
            pos = np.arange(start_pos, end_pos)
            positions.extend(pos.tolist())
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            slots.extend((blocks[pos // bs] * bs + pos % bs).tolist())
            table = None
            if start_pos > 0:
                table = torch.tensor(state.block_ids[: -(-end_pos // bs)], device=self.device)
            spans.append(PrefillSpan(start_row, len(input_ids), end_pos, table))
            if end_pos == len(state.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_states.append(state)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            num_decode=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=spans,
        )
        return (
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            torch.tensor(sample_rows, device=self.device),
            sample_states,
        )


def _collect_logprobs(states: list[RequestState], out) -> list[TokenLogprobs | None]:
    chosen = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: list[TokenLogprobs | None] = []
    for i, state in enumerate(states):
        k = state.params.logprobs
        if k is None:
            result.append(None)
            continue
        ids = top_ids[i][:k] if top_ids is not None else []
        lps = top_lps[i][:k] if top_lps is not None else []
        result.append(TokenLogprobs(logprob=chosen[i], top_ids=ids, top_logprobs=lps))
    return result
