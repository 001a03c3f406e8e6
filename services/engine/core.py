"""In-process engine: scheduler core + model runner in one loop. Used by the offline `LLM`,
tests and benchmarks; the services split the same two cores across processes."""

from __future__ import annotations

import _thread
import weakref
from collections.abc import Sequence

from common.config import EngineConfig
from common.ipc import encoder
from common.sampling_params import SamplingParams
from common.validation import check_request
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from services.scheduler.speculation import SpecPolicy
from services.worker.model_runner import ModelRunner
from services.worker.parallel.ranks import Ranks


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ranks: Ranks | None = None
        if config.tensor_parallel_size == 1:
            self.runner = ModelRunner(config)
        else:  # this process is rank 0; the others run what `step` hands them
            if config.nnodes != 1:
                raise ValueError("the offline engine runs on one node: use nnodes 1")
            self.ranks = Ranks(
                config, on_rank_exit=lambda pid, code: _thread.interrupt_main(), warm_up=False
            )
            # Once only: on close(), on collection, or at exit, whichever comes first.
            self._stop_ranks = weakref.finalize(self, self.ranks.stop)
            self.runner = ModelRunner(self.ranks.config, self.ranks.comm)
        self.model_config = self.runner.model_cfg
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                prefill_chunk_tokens=config.prefill_chunk_tokens,
                max_model_len=self.max_model_len,
            ),
            self.block_manager,
            SpecPolicy.from_config(config),
        )

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        max_tokens = check_request(
            prompt_token_ids, params, self.max_model_len, self.model_config.vocab_size
        )
        self.block_manager.check_prompt(len(prompt_token_ids))
        return max_tokens

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        max_tokens = self.check(prompt_token_ids, params)
        self.scheduler.add_request(
            Request(req_id, prompt_token_ids, params, max_tokens, self.model_config.eos_token_ids)
        )

    def abort(self, req_id: str) -> bool:
        return self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """End the other tensor-parallel ranks (a no-op with one rank)."""
        if self.ranks is not None:
            self._stop_ranks()
            self.ranks = None

    def step(self) -> list[RequestUpdate]:
        plan = self.scheduler.schedule()
        if self.ranks is not None:
            self.ranks.send(encoder.encode(plan))
        result = self.runner.execute(plan)
        return self.scheduler.update(plan, result)
