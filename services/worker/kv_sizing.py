"""How many KV blocks fit. CPU: `--kv-cache-memory-gb`. CUDA: vLLM's method, from a profiled step:

    blocks = (total * gpu_memory_utilization - weights - activation peak - non-torch memory
              - CUDA graph reserve) // bytes per block

The activation peak is measured, not guessed: after the weights are loaded, one dummy step at
the scheduler's limits (max_num_batched_tokens tokens over max_num_seqs prefill chunks, then
logits and a sampler pass with every filter and penalty on for max_num_seqs rows) runs against a
one-block cache, and torch's peak allocation above the weights is what the KV cache must leave
free. The arithmetic is a pure function so it is tested on CPU.

`size_kv_pool` turns that into the runner's pool: the same block count on every rank, refused
where a CPU pool would not fit in memory, and max_model_len capped to what the pool holds.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from stoker.common.config import EngineConfig, fit_to_pool
from stoker.common.model_config import ModelConfig
from stoker.common.sampling_params import SamplingParams
from stoker.services.worker.cpu_tuning import resident_zeros
from stoker.services.worker.cuda_graphs import GRAPH_OVERHEAD_BYTES
from stoker.services.worker.models.layers import CausalLM
from stoker.services.worker.models.llama import LlamaForCausalLM
from stoker.services.worker.parallel.comm import Communicator
from stoker.services.worker.proposer import Proposer
from stoker.services.worker.sampler import Sampler, SamplingBatch
from stoker.services.worker.step_inputs import Chunk, build_step_inputs

log = logging.getLogger("stoker.worker")
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class KVPool:
    """The sized pool: the scheduler's blocks (the scratch block padded decode rows write to is
    one more) and the max_model_len they hold."""

    num_blocks: int
    block_size: int
    block_bytes: int  # K and V of one block: the target's, plus the proposer's
    source: str  # the flag, or the profile, the number came from
    max_model_len: int  # the configured one, capped to the pool's capacity

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        gib = self.num_blocks * self.block_bytes / GIB
        return (
            f"{self.num_blocks} blocks of {self.block_size} tokens = {tokens} tokens "
            f"({gib:.2f} GiB, from {self.source}); max_model_len {self.max_model_len}"
        )


def size_kv_pool(
    config: EngineConfig,
    model: CausalLM | None,
    block_bytes: int,
    max_model_len: int,
    graph_batch_sizes: list[int],
    comm: Communicator | None,
) -> KVPool:
    """The pool from --num-kv-blocks, else what fits (`_blocks_that_fit`). graph_batch_sizes:
    the decode batches that will be captured ([] for none)."""
    if config.num_kv_blocks:
        num_blocks, source = config.num_kv_blocks, "--num-kv-blocks"
    else:
        num_blocks, source = _blocks_that_fit(
            config, model, block_bytes, max_model_len, graph_batch_sizes
        )
    if comm is not None:  # each rank sized its own pool: the scheduler gets one number
        num_blocks = comm.min_int(num_blocks)
    if torch.device(config.device).type == "cpu" and not config.null_model:
        check_cpu_pool_fits((num_blocks + 1) * block_bytes, memory_available_bytes(), source)
    fitted = fit_to_pool(max_model_len, num_blocks, config.block_size)
    if fitted < max_model_len:
        log.warning(
            "KV cache holds %d tokens; capping max_model_len %d to it", fitted, max_model_len
        )
        max_model_len = fitted
    return KVPool(num_blocks, config.block_size, block_bytes, source, max_model_len)


def _blocks_that_fit(
    config: EngineConfig,
    model: CausalLM | None,
    block_bytes: int,
    max_model_len: int,
    graph_batch_sizes: list[int],
) -> tuple[int, str]:
    """(blocks, where the number came from), leaving room for the scratch block."""
    device = torch.device(config.device)
    if device.type != "cuda":
        blocks = cpu_kv_blocks(config.kv_cache_memory_gb, block_bytes) - 1
        return max(1, blocks), f"--kv-cache-memory-gb {config.kv_cache_memory_gb}"
    profile = profile_gpu_memory(
        model,
        device=device,
        block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        graph_batch_sizes=graph_batch_sizes,
    )
    utilization = config.gpu_memory_utilization
    blocks = gpu_kv_blocks(profile, utilization, block_bytes) - 1
    return max(1, blocks), profile.describe(utilization)


def pool_block_bytes(
    cfg: ModelConfig,
    block_size: int,
    kv_heads: int,
    dtype: torch.dtype,
    proposer: Proposer | None,
) -> int:
    """K and V of one block over the target's layers (kv_heads: this rank's) and the
    proposer's, whose cache has as many blocks as the target's."""
    elem = torch.tensor([], dtype=dtype).element_size()
    # The null model sizes its (unallocated) pool as the real model would, so the scheduler
    # sees the same number of blocks.
    size = kv_block_bytes(cfg.num_layers, block_size, kv_heads, cfg.head_dim, elem)
    if proposer is not None:
        size += proposer.kv_block_bytes(elem)
    return size


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed KV memory, mapped at start-up (`resident_zeros`). Zeros (not garbage) matter:
    masked-out slots must not hold NaNs that 0 * NaN would spread."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    return resident_zeros(nbytes).view(dtype).view(shape)


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, elem_size: int
) -> int:
    """K and V of one block over all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem_size


def cpu_kv_blocks(memory_gb: float, block_bytes: int) -> int:
    return max(1, int(memory_gb * GIB // block_bytes))


def memory_available_bytes(meminfo_path: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory a process can take without swapping (MemAvailable), or
    None where there is none (not Linux)."""
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_cpu_pool_fits(pool_bytes: int, available_bytes: int | None, source: str) -> None:
    """The CPU KV pool is mapped in full at start-up (`cpu_tuning.resident_zeros`): one larger
    than the free memory would push the machine into swap or the OOM killer, so it is refused
    with the flag that sized it."""
    if available_bytes is not None and pool_bytes > available_bytes:
        raise ValueError(
            f"the KV cache needs {pool_bytes / GIB:.2f} GiB (from {source}) but only "
            f"{available_bytes / GIB:.2f} GiB of memory is available; lower {source.split()[0]}"
        )


@dataclasses.dataclass(frozen=True)
class GpuMemoryProfile:
    total_bytes: int  # the device's memory
    weights_bytes: int  # what torch held after loading (weights, rope tables)
    activation_peak_bytes: int  # torch's peak above that during the dummy step
    non_torch_bytes: int  # used device memory torch did not allocate: CUDA context, cuBLAS, others
    graph_reserve_bytes: int  # CUDA graphs' pool and executables (0 with --enforce-eager)

    def describe(self, utilization: float) -> str:
        return (
            f"{utilization:.2f} x {self.total_bytes / GIB:.1f} GiB - weights "
            f"{self.weights_bytes / GIB:.2f} - activations {self.activation_peak_bytes / GIB:.2f}"
            f" - non-torch {self.non_torch_bytes / GIB:.2f} - CUDA graphs "
            f"{self.graph_reserve_bytes / GIB:.2f} GiB"
        )


def gpu_kv_blocks(profile: GpuMemoryProfile, utilization: float, block_bytes: int) -> int:
    budget = (
        int(profile.total_bytes * utilization)
        - profile.weights_bytes
        - profile.activation_peak_bytes
        - profile.non_torch_bytes
        - profile.graph_reserve_bytes
    )
    if budget < block_bytes:
        raise ValueError(
            f"no room for a KV cache: {profile.describe(utilization)} leaves "
            f"{budget / GIB:.2f} GiB, less than one {block_bytes}-byte block; raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens / --max-num-seqs"
        )
    return budget // block_bytes


def _dummy_chunks(num_tokens: int, num_seqs: int, max_model_len: int, block_size: int):
    """num_tokens split evenly over num_seqs prefill chunks from position 0 (each at most
    max_model_len), every slot in block 0 of a one-block cache."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    num_tokens = min(num_tokens, num_seqs * max_model_len)
    base, extra = divmod(num_tokens, num_seqs)
    chunks = []
    for i in range(num_seqs):
        length = base + (i < extra)
        chunks.append(Chunk([0] * length, 0, [0] * -(-length // block_size), 1))
    return chunks


def _dummy_step(
    model: LlamaForCausalLM,
    chunks: list[Chunk],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    device: torch.device,
    sample: bool,
) -> None:
    inputs = build_step_inputs(chunks, block_size, device)
    hidden = model(inputs.input_ids, inputs.positions, caches, inputs.meta)
    if not sample:
        return
    logits = model.compute_logits(hidden[inputs.sample_rows])
    rows = logits.shape[0]
    params = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        repetition_penalty=1.1,
        logprobs=5,
    )
    batch = SamplingBatch.build(
        [params] * rows, [[1, 2]] * rows, [[3]] * rows, model.cfg.vocab_size, device
    )
    Sampler()(logits, batch)


@torch.inference_mode()
def profile_gpu_memory(
    model: LlamaForCausalLM | None,
    *,
    device: torch.device,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    graph_batch_sizes: list[int],
) -> GpuMemoryProfile:
    """Run the dummy steps and read the numbers. graph_batch_sizes: the decode batches that will
    be captured (empty with --enforce-eager); their pool is about the largest one's activations."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    peak = graph_peak = 0
    if model is not None:
        cfg = model.cfg
        shape = (1, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = model.embed_tokens.dtype
        caches = [
            (torch.zeros(shape, dtype=dtype, device=device),) * 2 for _ in range(cfg.num_layers)
        ]
        scratch = torch.cuda.memory_allocated(device) - weights
        torch.cuda.reset_peak_memory_stats(device)
        chunks = _dummy_chunks(max_num_batched_tokens, max_num_seqs, max_model_len, block_size)
        _dummy_step(model, chunks, caches, block_size, device, sample=True)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - weights - scratch
        if graph_batch_sizes:
            torch.cuda.reset_peak_memory_stats(device)
            decode = [Chunk([0], 0, [0], 1) for _ in range(max(graph_batch_sizes))]
            _dummy_step(model, decode, caches, block_size, device, sample=False)
            torch.cuda.synchronize(device)
            graph_peak = torch.cuda.max_memory_allocated(device) - weights - scratch
        del caches
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    graph_reserve = graph_peak + GRAPH_OVERHEAD_BYTES * len(graph_batch_sizes)
    return GpuMemoryProfile(total, weights, peak, non_torch, graph_reserve)
