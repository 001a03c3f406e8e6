"""The decode CUDA-graph path: padding, persistent buffers, copy-in and slice-out.

Real capture needs CUDA. On CPU these tests run the very same path with `capture=False` (an
eager forward over the persistent buffers instead of a replay), so everything but the capture
itself is covered here; the CUDA-only test below and benchmarks/gpu_check.sh cover capture.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest
import torch

from stoker.common.config import EngineConfig
from stoker.common.config_args import add_flags, from_args, from_json, to_json
from stoker.services.engine import LLM, SamplingParams
from stoker.services.worker.cuda_graphs import DecodeGraphs, capture_sizes
from stoker.services.worker.step_inputs import Chunk
from tests.factory import make_model

NEW_TOKENS = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("graphs") / "model", "qwen3", head_dim=32)


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def _params(count: int, logprobs: int | None = None) -> list[SamplingParams]:
    """Different lengths, so the decode batch shrinks through sizes that need padding."""
    return [
        SamplingParams(
            temperature=0.0, max_tokens=3 + 2 * i % NEW_TOKENS, ignore_eos=True, logprobs=logprobs
        )
        for i in range(count)
    ]


def _generate(path, prompts, params, graphs: bool, **options):
    """Offline generation; with graphs, decode steps go through the padded path (eagerly).
    Returns the LLM, its outputs, (real rows, padded size) per graph-path step, and the number
    of steps that ran a forward."""
    options = dict(num_kv_blocks=128, max_model_len=256) | options
    llm = LLM(str(path), **options)
    runner = llm.engine.runner
    assert runner.graphs is None, "never captured on CPU"
    sizes: list[tuple[int, int]] = []
    steps = [0]
    execute = runner.execute

    def counting(plan):
        steps[0] += bool(plan.new_requests or plan.running.req_ids)
        return execute(plan)

    runner.execute = counting
    if graphs:
        runner.use_decode_graphs(capture=False)
        graphs_ = runner.graphs
        prepare, prepare_rows = graphs_.prepare, graphs_.prepare_rows

        def recorded(n: int) -> None:
            sizes.append((n, graphs_._pending[0].input_ids.shape[0]))

        def recording(chunks):
            prepare(chunks)
            recorded(len(chunks))

        def recording_rows(token_ids, positions, tables):  # the runner's plain decode steps
            prepare_rows(token_ids, positions, tables)
            recorded(len(token_ids))

        graphs_.prepare, graphs_.prepare_rows = recording, recording_rows
    outs = llm.generate(prompts, params, use_tqdm=False)
    blocks = llm.engine.block_manager
    blocks.check_invariants()
    assert blocks.num_free_blocks() == blocks.num_blocks
    return llm, outs, sizes, steps[0]


def _logprob_rows(outs) -> list[torch.Tensor]:
    return [torch.tensor([lp.logprob for lp in o.logprobs]) for o in outs]


def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 35


def _unmodelled_graphs(max_model_len: int, scratch_block: int) -> DecodeGraphs:
    """Eager-replay graphs of batch sizes up to 8 and no model: prepare() never touches it."""
    return DecodeGraphs(
        None,
        [],
        max_batch=8,
        max_model_len=max_model_len,
        block_size=16,
        scratch_block=scratch_block,
        device=torch.device("cpu"),
        capture=False,
    )


def test_padding_rows_write_the_scratch_block_only():
    """The persistent buffer after prepare(): real rows, then padding that stores into the
    scratch block and attends to one slot of it; tables padded to max_model_len columns."""
    graphs = _unmodelled_graphs(max_model_len=100, scratch_block=50)
    chunks = [Chunk([7], 0, [3], 1), Chunk([8], 37, [4, 9, 11], 1), Chunk([9], 16, [5, 6], 0)]
    graphs.prepare(chunks)
    entry, num = graphs._pending
    meta = entry.meta
    assert num == 3 and meta.num_decode == 4 and meta.decode_block_tables.shape == (4, 7)
    assert entry.input_ids.tolist() == [7, 8, 9, 0]
    assert entry.positions.tolist() == [0, 37, 16, 0]
    assert meta.slot_mapping.tolist() == [3 * 16, 11 * 16 + 5, 6 * 16, 50 * 16]
    assert meta.decode_context_lens.tolist() == [1, 38, 17, 1]
    assert meta.decode_block_tables[:3, :3].tolist() == [[3, 0, 0], [4, 9, 11], [5, 6, 0]]
    assert meta.decode_block_tables[3, 0] == 50
    assert graphs.accepts(chunks)
    assert not graphs.accepts([Chunk([1, 2], 0, [3], 1)]), "prefill and verify run eagerly"
    assert not graphs.accepts([Chunk([1], 0, [3], 1)] * 9), "past the largest size"
    assert not graphs.accepts([])


def test_block_table_columns_only_ever_hold_block_ids():
    """A smaller batch after a larger one: unused table columns must still be block ids (the
    torch reference gathers every column), never another batch size's ids or positions."""
    graphs = _unmodelled_graphs(max_model_len=64, scratch_block=10)
    graphs.prepare([Chunk([40000 + i], 5 + i, [i], 1) for i in range(8)])
    graphs.prepare([Chunk([7], 3, [2], 1)])
    tables = graphs._pending[0].meta.decode_block_tables
    assert tables.shape == (1, 4) and tables[0, 0] == 2
    assert all(0 <= b <= 10 for b in tables.flatten().tolist()), tables


def test_greedy_and_logprobs_equal_the_eager_path(model_path):
    """11 requests, at most 8 captured: decode batches of 1..8 are padded (3 -> 4, 5 -> 8, ...),
    larger ones and prefill steps run eagerly; tokens equal, logprobs to float32 rounding."""
    prompts = _prompts(1, 11)
    params = _params(11, logprobs=3)
    options = dict(max_num_seqs=11, max_cudagraph_capture_size=8)
    _, want, _, _ = _generate(model_path, prompts, params, graphs=False, **options)
    llm, got, sizes, steps = _generate(model_path, prompts, params, graphs=True, **options)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(_logprob_rows(got), _logprob_rows(want)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    for g, w in zip(got, want):
        assert [lp.top_ids for lp in g.logprobs] == [lp.top_ids for lp in w.logprobs]
    padded = {(n, size) for n, size in sizes if n != size}
    assert padded, f"no step needed padding: {sizes}"
    assert all(size == capture_sizes(8)[np.searchsorted(capture_sizes(8), n)] for n, size in sizes)
    assert llm.engine.runner.graphs.num_replays == len(sizes) < steps


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_mixed_eager_and_graph_steps(model_path, speculative):
    """Chunked prefill and speculative verify steps run eagerly between graph-path decode steps
    (the speculation cut-off at 4 decoding requests makes larger decode batches plain)."""
    rng = random.Random(3)
    unit = [rng.randrange(3, 500) for _ in range(4)]
    prompts = [unit * 6, *_prompts(4, 5), unit * 3 + [9, 9]]
    # Seven decoding requests are too many to speculate (graph path); once the five short ones
    # finish, the repetitive two speculate (eager verify steps).
    lengths = (24, 6, 7, 8, 6, 7, 20)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    options = dict(
        max_num_seqs=8,
        max_num_batched_tokens=48,
        speculative=speculative,
        speculative_max_batch=4,
    )
    if speculative == "draft":
        options["speculative_model"] = str(model_path)  # its own draft: every draft accepted
    _, plain, _, _ = _generate(model_path, prompts, params, graphs=False, max_num_seqs=8)
    llm, got, sizes, steps = _generate(model_path, prompts, params, graphs=True, **options)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert llm.engine.scheduler.spec.stats.drafts > 0, "no verify step ran"
    assert 0 < len(sizes) < steps, "want both graph-path decode steps and eager steps"


def test_chunked_prefill_of_a_lone_prompt_stores_every_chunk(model_path):
    """A step whose only chunk samples nothing (the first chunks of a long prompt) must still
    run the forward, or those positions' K/V never reach the cache."""
    prompt = [(7 * i) % 400 + 3 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    whole = LLM(str(model_path), num_kv_blocks=64).generate([prompt], params)[0].token_ids
    chunked = LLM(str(model_path), num_kv_blocks=64, max_num_batched_tokens=16)
    assert chunked.generate([prompt], params)[0].token_ids == whole


def test_enforce_eager_flag_round_trips():
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    args = parser.parse_args(["--enforce-eager", "--max-cudagraph-capture-size", "64"])
    config = from_args(EngineConfig, args)
    assert config.enforce_eager and config.max_cudagraph_capture_size == 64
    again = from_json(EngineConfig, to_json(config))  # what `stoker serve` hands the worker
    assert again.enforce_eager and again.max_cudagraph_capture_size == 64
    assert not from_args(EngineConfig, parser.parse_args([])).enforce_eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_real_capture_matches_enforce_eager(model_path):
    """On CUDA: graphs are captured by default, replayed for decode steps, and greedy output and
    logprobs match --enforce-eager (float32 model, so differences are rounding only)."""
    prompts = _prompts(5, 11)
    params = _params(11, logprobs=2)
    options = dict(device="cuda", num_kv_blocks=128, max_model_len=256, max_num_seqs=11)
    eager = LLM(str(model_path), enforce_eager=True, **options)
    assert eager.engine.runner.graphs is None
    want = eager.generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_path), **options)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and all(e.graph is not None for e in graphs._entries.values())
    got = llm.generate(prompts, params, use_tqdm=False)
    assert graphs.num_replays > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(_logprob_rows(got), _logprob_rows(want)):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)
