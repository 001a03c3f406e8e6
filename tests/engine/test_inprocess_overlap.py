"""The in-process engine with overlap (the runner on its own thread, two plans in flight; on by
default on CUDA) gives what the serial loop gives: the same tokens, text and finish reasons on
every path that depends on the order of plans and results (greedy, seeded sampling, n > 1, stop
strings that abort a request mid-flight, preemption, n-gram speculation), and no leaked blocks.
"""

from __future__ import annotations

import threading

import pytest

from stoker.services.engine import LLM, SamplingParams
from tests.factory import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("overlap") / "model", "llama")


def _requests(vocab: int = 512):
    prompts = [[5, 6, 7], list(range(10, 60)), "The quick brown fox", [9] * 30, "a b c d"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=17, ignore_eos=True, seed=11),
        SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=5, n=2),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["e", "a"]),
    ]
    return prompts, params


def _run(model, overlap: bool, **options):
    llm = LLM(model, overlap=overlap, **({"max_model_len": 256} | options))
    assert llm.engine.overlap is overlap
    prompts, params = _requests()
    outs = llm.generate(prompts, params)
    second = llm.generate(prompts[:2], params[:2])  # a second call on the drained engine
    blocks = llm.engine.block_manager
    blocks.check_invariants()
    assert blocks.num_free_blocks() == blocks.num_blocks
    assert not llm.engine.has_unfinished()
    result = [(c.token_ids, c.text, c.finish_reason) for o in [*outs, *second] for c in o.outputs]
    preemptions = llm.engine.scheduler.num_preemptions
    llm.close()
    return result, preemptions


@pytest.mark.parametrize(
    "options",
    [
        dict(num_kv_blocks=128),
        # Six blocks of 16 tokens for six requests that grow to 25-67 tokens: preemption.
        dict(num_kv_blocks=6, max_num_seqs=6, max_model_len=96),
        dict(num_kv_blocks=128, speculative="ngram"),
    ],
    ids=["plain", "preempt", "ngram"],
)
def test_overlapped_engine_matches_the_serial_one(model, options):
    serial, serial_preemptions = _run(model, False, **options)
    overlapped, preemptions = _run(model, True, **options)
    assert overlapped == serial
    if options["num_kv_blocks"] == 6:
        assert preemptions > 0 and serial_preemptions > 0
    stopped = [r for r in serial if r[2] == "stop"]
    assert stopped, "the stop-string request must stop early"


def test_steps_run_on_the_runner_thread(model):
    llm = LLM(model, overlap=True, num_kv_blocks=64, max_model_len=128)
    threads = set()
    execute = llm.engine.runner.execute

    def recording(plan):
        threads.add(threading.current_thread().name)
        return execute(plan)

    llm.engine.runner.execute = recording
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert threads and all(name.startswith("stoker-runner") for name in threads)
    llm.close()
    assert llm.engine._runner_thread is None and not llm.engine.overlap


def test_an_error_in_a_step_reaches_the_caller_with_nothing_left_in_flight(model):
    llm = LLM(model, overlap=True, num_kv_blocks=64, max_model_len=128)
    execute = llm.engine.runner.execute
    calls = {"n": 0}

    def failing(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fault")
        return execute(plan)

    llm.engine.runner.execute = failing
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="device fault"):
        llm.generate([[5, 6, 7], [8, 9]], greedy)
    assert not llm.engine._inflight
    llm.close()
