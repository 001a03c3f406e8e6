"""KV cache sizing: the CUDA arithmetic (a pure function, so it runs here), the CPU pool, the
dummy profiling batch, and what the worker logs."""

from __future__ import annotations

import logging

import pytest
import torch

from stoker.common.config import EngineConfig
from stoker.services.worker.drafter import Drafter
from stoker.services.worker.kv_sizing import (
    GIB,
    GpuMemoryProfile,
    _dummy_chunks,
    check_cpu_pool_fits,
    cpu_kv_blocks,
    gpu_kv_blocks,
    kv_block_bytes,
    memory_available_bytes,
)
from stoker.services.worker.model_runner import ModelRunner
from tests.factory import make_model

MIB = 1024**2


def test_block_bytes_qwen3_0_6b_shape():
    # 28 layers, 8 KV heads of 128, bf16, 16 tokens: 2 * 28 * 16 * 8 * 128 * 2 bytes.
    assert kv_block_bytes(28, 16, 8, 128, 2) == 1_835_008


def test_gpu_blocks_subtract_everything_before_dividing():
    profile = GpuMemoryProfile(
        total_bytes=140 * GIB,
        weights_bytes=int(1.2 * GIB),
        activation_peak_bytes=700 * MIB,
        non_torch_bytes=500 * MIB,
        graph_reserve_bytes=100 * MIB,
    )
    block = kv_block_bytes(28, 16, 8, 128, 2)
    budget = int(140 * GIB * 0.9) - int(1.2 * GIB) - 1300 * MIB
    assert gpu_kv_blocks(profile, 0.9, block) == budget // block
    assert gpu_kv_blocks(profile, 0.5, block) < gpu_kv_blocks(profile, 0.9, block)
    assert "0.90 x 140.0 GiB - weights 1.20" in profile.describe(0.9)


def test_gpu_blocks_refuse_when_nothing_is_left():
    profile = GpuMemoryProfile(10 * GIB, 6 * GIB, 2 * GIB, GIB, 0)
    with pytest.raises(ValueError, match="no room for a KV cache.*gpu-memory-utilization"):
        gpu_kv_blocks(profile, 0.9, 2 * MIB)


def test_cpu_blocks_from_the_memory_budget():
    assert cpu_kv_blocks(1.0, MIB) == 1024
    assert cpu_kv_blocks(1e-9, MIB) == 1  # never zero


@pytest.mark.parametrize(
    "tokens, seqs, max_len, want_seqs, want_tokens",
    [(2048, 256, 4096, 256, 2048), (100, 256, 4096, 100, 100), (8192, 2, 1000, 2, 2000)],
)
def test_profiling_batch_matches_the_scheduler_limits(
    tokens, seqs, max_len, want_seqs, want_tokens
):
    chunks = _dummy_chunks(tokens, seqs, max_len, block_size=16)
    lengths = [len(c.token_ids) for c in chunks]
    assert len(chunks) == want_seqs and sum(lengths) == want_tokens
    assert max(lengths) - min(lengths) <= 1 and max(lengths) <= max_len
    assert all(c.start == 0 and c.num_sampled == 1 for c in chunks)
    assert all(len(c.block_ids) * 16 >= len(c.token_ids) for c in chunks)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("sizing") / "model", "llama")


def test_worker_logs_blocks_and_tokens(model_path, caplog):
    caplog.set_level(logging.INFO, logger="stoker.worker")
    runner = ModelRunner(EngineConfig(model=str(model_path), kv_cache_memory_gb=0.01))
    block = kv_block_bytes(2, 16, 2, 16, 4)
    assert runner.num_blocks == int(0.01 * GIB // block) - 1  # one scratch block set aside
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks + 1
    tokens = runner.num_blocks * 16
    want = f"KV cache: {runner.num_blocks} blocks of 16 tokens = {tokens} tokens"
    assert any(want in r.getMessage() for r in caplog.records), caplog.text
    assert "--kv-cache-memory-gb 0.01" in caplog.text


def test_draft_cache_counts_against_the_pool(model_path):
    alone = ModelRunner(EngineConfig(model=str(model_path), kv_cache_memory_gb=0.01))
    with_draft = ModelRunner(
        EngineConfig(
            model=str(model_path), kv_cache_memory_gb=0.01, speculative_model=str(model_path)
        )
    )
    # The draft is the model itself here: twice the bytes per block, about half the blocks.
    assert with_draft.num_blocks == int(0.01 * GIB // (2 * kv_block_bytes(2, 16, 2, 16, 4))) - 1
    assert with_draft.num_blocks < alone.num_blocks
    assert isinstance(with_draft.proposer, Drafter)
    assert with_draft.proposer.kv_caches[0][0].shape[0] == with_draft.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiling reads CUDA memory stats")
def test_cuda_sizing_profiles_and_fits(model_path):
    runner = ModelRunner(
        EngineConfig(model=str(model_path), device="cuda", gpu_memory_utilization=0.05)
    )
    total = torch.cuda.mem_get_info()[1]
    assert runner.num_blocks * kv_block_bytes(2, 16, 2, 16, 4) <= 0.05 * total
    assert runner.num_blocks > 1000


def test_memory_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000 kB\n")
    assert memory_available_bytes(str(meminfo)) == 1000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert memory_available_bytes(str(meminfo)) is None
    assert memory_available_bytes(str(tmp_path / "missing")) is None


def test_a_pool_larger_than_free_memory_is_refused_with_its_flag():
    check_cpu_pool_fits(GIB, 2 * GIB, "--kv-cache-memory-gb 1.0")
    check_cpu_pool_fits(GIB, None, "--kv-cache-memory-gb 1.0")  # no meminfo: nothing to check
    with pytest.raises(ValueError, match=r"needs 4.00 GiB .* only 2.00 GiB .* lower --num-kv"):
        check_cpu_pool_fits(4 * GIB, 2 * GIB, "--num-kv-blocks")


def test_worker_refuses_a_pool_beyond_free_memory(model_path):
    free = memory_available_bytes()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    gb = 2 * free / GIB + 1
    with pytest.raises(ValueError, match="--kv-cache-memory-gb"):
        ModelRunner(EngineConfig(model=str(model_path), kv_cache_memory_gb=gb))
