"""In-process engine: scheduler core + model runner in one loop. Used by the offline `LLM`,
tests and benchmarks; the services split the same two cores across processes.

On CUDA the loop overlaps as the service set does (docs/overlap.md): the runner executes step N
on a thread of its own while this thread plans N + 1 and applies N - 1's result, so the
scheduler's and the caller's host work (the offline LLM detokenizes every step) runs while the
device computes instead of between steps. The runner's thread waits on the device with the GIL
released. On CPU the runner's torch threads want every core, so steps stay serial there unless
`overlap=True` asks (the tests do, to check that both orders give the same tokens)."""

from __future__ import annotations

import _thread
import collections
import contextlib
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from stoker.common.config import EngineConfig
from stoker.common.ipc import encoder
from stoker.common.messages import StepPlan, StepResult
from stoker.common.sampling_params import SamplingParams
from stoker.services.scheduler.admission import Admission
from stoker.services.scheduler.block_manager import BlockManager
from stoker.services.scheduler.config import SchedulerConfig
from stoker.services.scheduler.request import RequestUpdate
from stoker.services.scheduler.scheduler import Scheduler
from stoker.services.scheduler.speculation import SpecPolicy
from stoker.services.worker.model_runner import ModelRunner
from stoker.services.worker.parallel.ranks import Ranks


class EngineCore:
    def __init__(self, config: EngineConfig, overlap: bool | None = None) -> None:
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
            SchedulerConfig.from_engine(config, self.max_model_len),
            self.block_manager,
            SpecPolicy.from_config(config),
        )
        self.admission = Admission(
            self.scheduler, self.block_manager, self.max_model_len, self.model_config
        )
        if overlap is None:
            overlap = self.runner.device.type == "cuda"
        # Tensor-parallel ranks take plans in the order rank 0 runs them: kept serial. An
        # overlapped engine may be switched to serial steps (False) while nothing is in flight
        # (benchmarks compare the two on one engine).
        self.overlap = overlap and self.ranks is None
        self._runner_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="stoker-runner") if self.overlap else None
        )
        self._inflight: collections.deque[tuple[StepPlan, Future[StepResult]]] = collections.deque()

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        return self.admission.check(prompt_token_ids, params)

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.admission.add(req_id, prompt_token_ids, params)

    def abort(self, req_id: str) -> bool:
        return self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        # A step still in flight has a result to apply (dropped if its requests are done).
        return self.scheduler.has_unfinished() or bool(self._inflight)

    def close(self) -> None:
        """Finish the step in flight, stop the runner's thread, and end the other tensor-parallel
        ranks (a no-op with one rank)."""
        self._settle()
        if self._runner_thread is not None:
            self._runner_thread.shutdown()
            self._runner_thread = None
            self.overlap = False
        if self.ranks is not None:
            self._stop_ranks()
            self.ranks = None

    def step(self) -> list[RequestUpdate]:
        if not self.overlap:
            plan = self.scheduler.schedule()
            if self.ranks is not None:
                self.ranks.send(encoder.encode(plan))
            result = self.runner.execute(plan)
            return self.scheduler.update(plan, result)
        assert self._runner_thread is not None
        try:
            # Two plans in flight, as the scheduler service keeps: N + 1 is planned (its
            # requests' next tokens are placeholders) and queued before N's result is waited on.
            while len(self._inflight) < 2:
                plan = self.scheduler.schedule()
                if not (plan.num_requests or plan.finished_req_ids):
                    break
                self._inflight.append((plan, self._runner_thread.submit(self.runner.execute, plan)))
                if not plan.num_requests:
                    break
            if not self._inflight:
                return []
            plan, result = self._inflight.popleft()
            return self.scheduler.update(plan, result.result())
        except BaseException:
            self._settle()
            raise

    def _settle(self) -> None:
        """Wait out the steps in flight and drop them (after an error, or on close)."""
        while self._inflight:
            _, result = self._inflight.popleft()
            with contextlib.suppress(Exception):  # the error that stopped us is raised already
                result.result()
