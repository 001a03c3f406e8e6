"""The GPU checks of issue 7, one phase per process (benchmarks/gpu_check.sh runs them in order,
each under a hard timeout, then merges):

    model       build the Qwen3-0.6B-shaped random-init folder (bf16) with a tokenizer
    kernels     every triton kernel against its torch reference on cuda, bf16 and fp32, GQA 1/4/8,
                head dim 64/128, block size 16/32 (a pairwise-covering set of shapes)
    hf          greedy agreement with HF transformers in bf16, tolerance-based on logits
    decode      batch-1 decode ms/token with and without CUDA graphs
    throughput  the nano-vllm workload: 256 requests, input/output lengths uniform 100-1024
    timing      decode attention, RMSNorm and rotary against the bandwidth floor
    serve       `stoker serve --device cuda` (real processes, ZMQ, HTTP): one completion, then
                `stoker bench serve` at 128 streams, and no KV block leaked at idle
    paths       n-gram speculation, prefix caching and preemption against plain greedy (fp32)
    profile     torch.profiler's top kernels (batch-1 decode, a workload slice) and cProfile of
                eager batch-1 forwards, into WORK/profile_*.txt

    python benchmarks/gpu_check.py PHASE --work DIR [--smoke]
    python benchmarks/gpu_check.py merge --work DIR --out FILE

Each phase writes DIR/PHASE.json as it goes, so a phase killed by its timeout still leaves what
it measured. `--smoke` runs every phase at tiny shapes on CPU (tests/bench/test_gpu_check.py);
the kernels phase then needs TRITON_INTERPRET=1, and CUDA graphs run in their eager-replay mode.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

PHASES = (
    "model", "kernels", "hf", "decode", "throughput", "timing", "serve", "paths", "profile"
)  # fmt: skip
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    initializer_range=0.02,
)
SMOKE_MODEL = dict(
    QWEN3_0_6B,
    vocab_size=1024,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=128,
)
# Reference points from the issue (HF on the same H200).
HF_DECODE_MS = {"dynamic_cache": 25.3, "static_cache_compiled": 3.46}
HF_GENERATE_BATCH_TOK_S = 794


class Report:
    """One phase's JSON, rewritten after every record so a timeout keeps what was measured."""

    def __init__(self, path: Path, phase: str, smoke: bool) -> None:
        self.path = path
        self.data: dict = {"phase": phase, "smoke": smoke, "ok": None, "records": []}
        self.data["device"] = torch.cuda.get_device_name() if _cuda() else "cpu"
        self.save()

    def add(self, **record) -> None:
        self.data["records"].append(record)
        self.save()

    def set(self, **values) -> None:
        self.data.update(values)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def _cuda() -> bool:
    return torch.cuda.is_available()


def _device() -> torch.device:
    return torch.device("cuda" if _cuda() else "cpu")


def _dtype() -> torch.dtype:
    return torch.bfloat16 if _cuda() else torch.float32


def _dtype_name() -> str:
    return str(_dtype()).removeprefix("torch.")


def bench(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Seconds per call: CUDA events on the GPU, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    if not _cuda():
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000 / iters


def copy_bandwidth(nbytes: int) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=_device())
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src), iters=10)


def _free() -> None:
    gc.collect()
    if _cuda():
        torch.cuda.empty_cache()


def _model_path(work: Path) -> Path:
    return work / "model"


def _llm(work: Path, **options):
    from services.engine import LLM

    base = dict(device=str(_device()), dtype=_dtype_name())
    return LLM(str(_model_path(work)), **(base | options))


class StepTimes:
    """Sums the worker's own step telemetry (prepare / forward / sample) over a run."""

    def __init__(self, runner) -> None:
        self.reset()
        execute = runner.execute

        def timed(plan):
            result = execute(plan)
            if result.req_ids:
                self.steps += 1
                self.prepare_s += result.prepare_s
                self.forward_s += result.forward_s
                self.sample_s += result.sample_s
            return result

        runner.execute = timed

    def reset(self) -> None:
        self.steps = 0
        self.prepare_s = self.forward_s = self.sample_s = 0.0

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "worker_prepare_s": round(self.prepare_s, 3),
            "worker_forward_s": round(self.forward_s, 3),
            "worker_sample_s": round(self.sample_s, 3),
        }


# -- model -----------------------------------------------------------------------------------------


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with one word per id ("w123"), so every sampled id decodes to text
    (the BPE test tokenizer has 512 tokens; this model samples ids up to 151936)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def phase_model(work: Path, smoke: bool, report: Report) -> bool:
    from tests.factory import make_model

    path = _model_path(work)
    shape = SMOKE_MODEL if smoke else QWEN3_0_6B
    if not (path / "config.json").is_file():
        started = time.perf_counter()
        build = dict(dtype=_dtype(), with_tokenizer=False, seed=0, **shape)
        try:
            with torch.device(_device()):  # random init on the GPU: seconds, not a minute
                make_model(path, "qwen3", **build)
        except Exception as e:  # a transformers that ignores the device context: the CPU
            report.set(device_init_error=f"{type(e).__name__}: {e}")
            make_model(path, "qwen3", **build)
        word_tokenizer(shape["vocab_size"]).save_pretrained(path)
        report.set(build_s=round(time.perf_counter() - started, 1))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    report.set(path=str(path), shape=shape, dtype=_dtype_name(), weight_bytes=size)
    return True


# -- kernels ---------------------------------------------------------------------------------------

# Pairwise covering of GQA group x head dim x block size; each runs in bf16 and fp32.
COVER = [(1, 64, 16), (1, 128, 32), (4, 64, 32), (4, 128, 16), (8, 64, 16), (8, 128, 32)]
TOL = {torch.float32: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _kernel_cases(smoke: bool):
    """(name, dtype, group, head_dim, block_size, sizes) for every check."""
    dtypes = (torch.bfloat16, torch.float32)
    cover = [(1, 64, 16), (4, 128, 32)] if smoke else COVER
    big = dict(batch=64, max_ctx=2000, split_batch=2, prefix=1000, chunk=300, tokens=4096)
    sizes = dict(batch=3, max_ctx=40, split_batch=2, prefix=20, chunk=9, tokens=8) if smoke else big
    cases = []
    for dtype in dtypes:
        for i, (group, head_dim, bs) in enumerate(cover):
            common = (dtype, group, head_dim, bs, sizes)
            cases += [("decode", *common), ("decode_split", *common)]
            cases += [("prefill_paged", *common), ("causal", *common)]
            if i % 3 == 0 or smoke:
                cases.append(("varlen", *common))
            if group in (1, 8):
                cases += [("rotary", *common), ("rotary_by_position", *common)]
            if i < 4:
                cases.append(("store_kv", *common))
        for name in ("rms_norm", "add_rms_norm", "qk_rms_norm"):
            cases.append((name, dtype, 1, 128, 16, sizes))
    cases.append(("race", torch.float32, 1, 128, 16, sizes))
    cases += [("silu_and_mul", dtype, 1, 128, 16, sizes) for dtype in dtypes]
    only = os.environ.get("GPU_CHECK_KERNELS")  # e.g. "rotary,race": a re-run of a few
    if only:
        cases = [c for c in cases if c[0] in only.split(",")]
    return cases


def _check_kernel(name, dtype, group, head_dim, bs, sizes, gen) -> tuple[float, bool]:
    """Runs one kernel and its reference on fresh random inputs; (max abs error, within tol).
    Attention references run in float32 on the same (rounded) inputs."""
    from kernels import paged_attention as ref_attn
    from kernels import rms_norm as ref_norm
    from kernels import rotary as ref_rope
    from kernels import triton_attention as ta
    from kernels import triton_norm_rope as tn

    dev = _device()
    num_kv = 2 if sizes["tokens"] < 100 else 8
    num_q = num_kv * group
    scale = head_dim**-0.5

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=dev).to(dt)

    def paged(lens, extra_columns=2):
        width = max(-(-n // bs) for n in lens) + extra_columns
        blocks = len(lens) * width + 1
        kc = randn(blocks, bs, num_kv, head_dim)
        vc = randn(blocks, bs, num_kv, head_dim)
        perm = torch.randperm(blocks, generator=gen, device=dev)
        return kc, vc, perm[: len(lens) * width].view(len(lens), width)

    def lens_of(count, hi):
        return torch.randint(1, hi + 1, (count,), generator=gen, device=dev)

    tol = TOL[dtype]
    if name == "silu_and_mul":
        from kernels import activation as ref_act
        from kernels import triton_activation as tact

        gate_up = randn(sizes["tokens"], 2 * (3072 if sizes["tokens"] > 100 else 96)) * 4
        got, want = tact.silu_and_mul(gate_up), ref_act.silu_and_mul(gate_up)
        got, want = got.float(), want.float()
        err = (got - want).abs().nan_to_num(float("inf")).max().item()
        return err, bool(torch.allclose(got, want, **tol))
    if name == "race":
        # The fused sampling race against the materialised torch-twin noise: same noise bits,
        # so a different pick is allowed only at a near tie (the log and division may differ
        # by an ulp). The first value returned is the number of rows that picked differently.
        from kernels import triton_sampling as ts
        from services.worker.sampling_noise import _noise_torch

        rows, vocab = (4, 3000) if sizes["tokens"] < 100 else (256, 151936)
        probs = torch.rand(rows, vocab, generator=gen, device=dev) ** 4
        keys = torch.randint(0, 2**62, (rows,), generator=gen, device=dev)
        got_ids = ts.race_sample(probs, keys)
        scores = probs / _noise_torch(keys, vocab)
        want_ids = scores.max(dim=-1).indices
        best = scores.gather(1, want_ids[:, None])
        gap = ((best - scores.gather(1, got_ids[:, None])) / best).max().item()
        return float((got_ids != want_ids).sum().item()), gap <= 1e-5
    if name in ("decode", "decode_split"):
        count = sizes["batch"] if name == "decode" else sizes["split_batch"]
        lens = lens_of(count, sizes["max_ctx"])
        # The split case also pads the tables as the CUDA-graph path does (width from
        # max_model_len): the launch grid comes from the width, work from the lengths.
        kc, vc, tables = paged(lens.tolist(), 2 if name == "decode" else 64)
        q = randn(count, num_q, head_dim)
        got = ta.paged_decode_attention(q, kc, vc, tables, lens, scale)
        want = ref_attn.paged_decode_attention(
            q.float(), kc.float(), vc.float(), tables, lens, scale
        )
    elif name == "prefill_paged":
        ctx = sizes["prefix"] + sizes["chunk"]
        kc, vc, tables = paged([ctx])
        q = randn(sizes["chunk"], num_q, head_dim)
        got = ta.paged_prefill_attention(q, kc, vc, tables[0], ctx, scale)
        want = ref_attn.paged_prefill_attention(
            q.float(), kc.float(), vc.float(), tables[0], ctx, scale
        )
    elif name == "causal":
        n = sizes["chunk"] * 2 + 1
        q, k, v = randn(n, num_q, head_dim), randn(n, num_kv, head_dim), randn(n, num_kv, head_dim)
        got = ta.causal_attention(q, k, v, scale)
        want = ref_attn.causal_attention(q.float(), k.float(), v.float(), scale)
    elif name == "varlen":
        # A chunk over a cached prefix, a verify of 5, a decode and a prefill from 0, in one launch.
        shapes = [(sizes["chunk"], sizes["prefix"] + sizes["chunk"]), (5, 33), (1, 70), (9, 9)]
        kc, vc, tables = paged([ctx for _, ctx in shapes])
        qlens = [n for n, _ in shapes]
        q = randn(sum(qlens), num_q, head_dim)
        cu = torch.tensor([0, *itertools.accumulate(qlens)], device=dev, dtype=torch.int32)
        ctx_lens = torch.tensor([c for _, c in shapes], device=dev)
        got = ta.paged_attention_varlen(q, kc, vc, tables, cu, ctx_lens, max(qlens), scale)
        want = torch.cat(
            [
                ref_attn.paged_prefill_attention(
                    q[cu[r] : cu[r + 1]].float(), kc.float(), vc.float(), tables[r], c, scale
                )
                for r, (_, c) in enumerate(shapes)
            ]
        )
    elif name == "store_kv":
        kc, vc, _ = paged([sizes["tokens"]])
        k, v = randn(sizes["tokens"], num_kv, head_dim), randn(sizes["tokens"], num_kv, head_dim)
        slots = torch.randperm(kc.shape[0] * bs, generator=gen, device=dev)[: sizes["tokens"]]
        want_k, want_v = kc.clone(), vc.clone()
        ref_attn.store_kv(want_k, want_v, k, v, slots)
        ta.store_kv(kc, vc, k, v, slots)
        got, want, tol = torch.stack([kc, vc]), torch.stack([want_k, want_v]), dict(rtol=0, atol=0)
    elif name in ("rms_norm", "add_rms_norm", "qk_rms_norm"):
        # Same-dtype references: the kernels mirror the reference's rounding steps.
        hidden = 1024 if sizes["tokens"] > 100 else 64
        shape = (
            (sizes["tokens"], 16, head_dim) if name == "qk_rms_norm" else (sizes["tokens"], hidden)
        )
        x, w = randn(*shape), randn(shape[-1])
        if name == "add_rms_norm":
            res = randn(*shape)
            got = torch.stack(tn.add_rms_norm(x, res, w, 1e-6))
            want = torch.stack(ref_norm.add_rms_norm(x, res, w, 1e-6))
        else:
            got, want = tn.rms_norm(x, w, 1e-6), ref_norm.rms_norm(x, w, 1e-6)
    else:  # rotary, rotary_by_position; Llama-3 scaled frequencies
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        cos, sin = ref_rope.rope_cos_sin(ref_rope.rope_inv_freq(head_dim, 5e5, scaling), 16384)
        cos, sin = cos.to(dev), sin.to(dev)
        n = sizes["tokens"]
        q, k = randn(n, num_q, head_dim), randn(n, num_kv, head_dim)
        pos = torch.randint(0, 16384, (n,), generator=gen, device=dev)
        # The kernels compute in float32 and round once, so the reference is float32 arithmetic
        # on the kernel's own inputs: per-token rows in `dtype`, or the float32 tables. (A
        # 16-bit reference rounds each product, and where q cos and k sin nearly cancel its
        # error is a few ulps of the products, not of the result.)
        if name == "rotary":
            c, s = cos[pos].to(dtype), sin[pos].to(dtype)
            got = torch.cat(tn.apply_rotary(q, k, c, s), 1)
        else:
            c, s = cos[pos], sin[pos]
            got = torch.cat(tn.apply_rotary_by_position(q, k, cos, sin, pos), 1)
        want = torch.cat(ref_rope.apply_rotary(q.float(), k.float(), c.float(), s.float()), 1)
    got, want = got.float(), want.float()
    err = (got - want).abs().nan_to_num(float("inf")).max().item()
    return err, bool(torch.allclose(got, want, **tol))


def phase_kernels(work: Path, smoke: bool, report: Report) -> bool:
    if not _cuda() and os.environ.get("TRITON_INTERPRET") != "1":
        report.set(skipped="no CUDA and TRITON_INTERPRET is not 1")
        return True
    from kernels import triton_attention as ta
    from kernels import triton_norm_rope as tn

    def nan_empty(shape, dtype, device):  # unwritten outputs cannot pass
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    ta._empty = tn._empty = nan_empty
    ok = True
    for i, (name, dtype, group, head_dim, bs, sizes) in enumerate(_kernel_cases(smoke)):
        gen = torch.Generator(_device()).manual_seed(i)
        case = dict(kernel=name, dtype=str(dtype), group=group, head_dim=head_dim, block_size=bs)
        started = time.perf_counter()
        try:
            err, passed = _check_kernel(name, dtype, group, head_dim, bs, sizes, gen)
        except Exception as e:
            err, passed = None, False
            case["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        ok = ok and passed
        report.add(**case, max_abs_err=err, ok=passed, s=round(time.perf_counter() - started, 2))
        print(f"kernels: {name} {dtype} G{group} D{head_dim} B{bs}: err {err} ok {passed}")
    return ok


# -- HF agreement ----------------------------------------------------------------------------------


def phase_hf(work: Path, smoke: bool, report: Report) -> bool:
    """Greedy agreement with HF in the same dtype, judged at a tolerance: stoker may pick another
    token than HF only where HF's top-2 logit margin is within twice the measured logit error
    there (a perturbation of at most e per logit cannot flip a wider margin)."""
    from transformers import AutoModelForCausalLM

    from common.sampling_params import SamplingParams
    from services.worker.step_inputs import Chunk, build_step_inputs

    dev, path = _device(), _model_path(work)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(1)
    lengths, new = ((5, 12, 30), 8) if smoke else ((17, 64, 100, 128), 32)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype()).to(dev).eval()
    hf_tokens, hf_logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=dev)
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            hf_tokens.append(out[0, len(prompt) :].tolist())
            hf_logits.append(hf(out).logits[0].float().cpu())  # teacher-forced, every position
    del hf
    _free()

    llm = _llm(
        work,
        max_model_len=2048,
        max_num_seqs=8,
        enable_prefix_caching=False,  # the teacher-forced pass below reuses free blocks
        **({"gpu_memory_utilization": 0.3} if _cuda() else {}),
    )
    runner = llm.engine.runner
    if not _cuda():
        runner.use_decode_graphs(capture=False)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ok = True
    for prompt, want_tokens, want_logits, out in zip(prompts, hf_tokens, hf_logits, outs):
        seq = prompt + want_tokens
        chunk = Chunk(seq, 0, list(range(-(-len(seq) // runner.block_size))), len(seq))
        with torch.inference_mode():
            inputs = build_step_inputs([chunk], runner.block_size, dev)
            model = runner.model
            hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
            got_logits = model.compute_logits(hidden[inputs.sample_rows]).float().cpu()
        err = (got_logits - want_logits).abs().max(dim=-1).values  # per position
        top2 = want_logits.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        agree = got_logits.argmax(-1) == want_logits.argmax(-1)
        unexplained = int((~agree & (margin > 2 * err)).sum())
        # Free-running generation (decode steps through the CUDA-graph path): first divergence.
        first = next(
            (i for i, (a, b) in enumerate(zip(out.token_ids, want_tokens)) if a != b), None
        )
        lp_err = 0.0
        hf_lp = torch.log_softmax(want_logits, dim=-1)
        for i in range(first if first is not None else new):
            pos = len(prompt) - 1 + i
            lp_err = max(lp_err, abs(out.logprobs[i].logprob - hf_lp[pos, want_tokens[i]].item()))
        diverged_ok = True
        record = dict(
            prompt_len=len(prompt),
            max_abs_logit_err=round(err.max().item(), 4),
            mean_abs_logit_err=round((got_logits - want_logits).abs().mean().item(), 5),
            teacher_forced_argmax_agreement=round(agree.float().mean().item(), 4),
            unexplained_disagreements=unexplained,
            generated_identical=first is None,
            decode_logprob_max_err=round(lp_err, 4),
        )
        if first is not None:
            pos = len(prompt) - 1 + first
            bound = 2 * max(err[pos].item(), lp_err)
            diverged_ok = margin[pos].item() <= bound
            record.update(
                first_divergence=first,
                hf_margin_there=round(margin[pos].item(), 4),
                allowed_margin=round(bound, 4),
            )
        passed = unexplained == 0 and diverged_ok
        ok = ok and passed
        report.add(**record, ok=passed)
        print("hf:", record)
    return ok


# -- batch-1 decode --------------------------------------------------------------------------------


def phase_decode(work: Path, smoke: bool, report: Report) -> bool:
    from common.sampling_params import SamplingParams
    from services.worker.step_inputs import Chunk

    dev = _device()
    vocab = json.loads((_model_path(work) / "config.json").read_text())["vocab_size"]
    prompt = [random.Random(2).randrange(3, vocab) for _ in range(16 if smoke else 128)]
    new = 8 if smoke else 256
    weights = sum(f.stat().st_size for f in _model_path(work).glob("*.safetensors"))
    bandwidth = copy_bandwidth(64 * 1024**2 if smoke else 2 * 1024**3)
    report.set(
        weight_bytes=weights,
        copy_gb_s=round(bandwidth / 1e9, 1),
        weight_read_floor_ms=round(weights / bandwidth * 1e3, 3),
        hf_reference_ms=HF_DECODE_MS,
        target_ms=1.0,
    )
    tokens = {}
    for graphs in (True, False):
        llm = _llm(
            work,
            max_model_len=2048,
            max_num_seqs=1,
            num_kv_blocks=256,
            enforce_eager=not graphs,
            overlap=True if smoke else None,  # the smoke run exercises the overlapped loop too
        )
        runner = llm.engine.runner
        if graphs and not _cuda():
            runner.use_decode_graphs(capture=False)
        greedy = dict(temperature=0.0, ignore_eos=True)
        llm.generate([prompt], SamplingParams(max_tokens=16, **greedy), use_tqdm=False)  # warm-up
        steps = StepTimes(runner)
        firsts, totals = [], []
        for _ in range(3):  # ms/token = (best time for `new` tokens - best for 1) / (new - 1)
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
            firsts.append(time.perf_counter() - started)
            steps.reset()
            started = time.perf_counter()
            out = llm.generate([prompt], SamplingParams(max_tokens=new, **greedy), use_tqdm=False)
            totals.append(time.perf_counter() - started)
        tokens[graphs] = out[0].token_ids
        step_times = steps.summary()  # before the serial comparison below adds its steps
        serial_ms = None
        if graphs and llm.engine.overlap:  # the same engine with its loop serial, for comparison
            llm.engine.overlap = False
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=new, **greedy), use_tqdm=False)
            serial_ms = (time.perf_counter() - started - min(firsts)) / (new - 1) * 1e3
            llm.engine.overlap = True
        # The model forward alone at batch 1, context ~len(prompt): replay vs eager launches.
        blocks = list(range(-(-(len(prompt) + 1) // runner.block_size)))
        forward = _batch1_forward(runner, Chunk([5], len(prompt), blocks, 1), dev)
        with torch.inference_mode():
            forward_s = bench(forward, iters=5 if smoke else 100)
        report.add(
            cuda_graphs=graphs,
            overlap=llm.engine.overlap,
            serial_loop_ms_per_token=None if serial_ms is None else round(serial_ms, 3),
            captured=runner.graphs is not None and runner.graphs._entries[1].graph is not None,
            ms_per_token=round((min(totals) - min(firsts)) / (new - 1) * 1e3, 3),
            one_token_ms_runs=[round(t * 1e3, 2) for t in firsts],
            all_tokens_ms_runs=[round(t * 1e3, 2) for t in totals],
            forward_only_ms=round(forward_s * 1e3, 3),
            **step_times,
        )
        print("decode:", report.data["records"][-1])
        del llm, runner
        _free()
    report.set(identical_tokens_with_and_without_graphs=tokens[True] == tokens[False])
    return True


def _batch1_forward(runner, chunk, dev: torch.device) -> Callable[[], object]:
    """The model forward alone for one decode row: the graph replay, or the eager launches."""
    from services.worker.step_inputs import build_step_inputs

    if runner.graphs is not None:
        with torch.inference_mode():
            runner.graphs.prepare([chunk])
        entry, _ = runner.graphs._pending
        if entry.graph is not None:
            return entry.graph.replay
        return lambda: runner.graphs._forward(entry)
    inputs = build_step_inputs([chunk], runner.block_size, dev)
    model, caches = runner.model, runner.kv_caches
    return lambda: model(inputs.input_ids, inputs.positions, caches, inputs.meta)


# -- throughput ------------------------------------------------------------------------------------


def nano_vllm_workload(smoke: bool):
    """nano-vllm's bench.py: seed 0, 256 prompts of randint(0, 10000) ids with lengths
    randint(100, 1024), then temperature 0.6, ignore_eos, max_tokens randint(100, 1024)."""
    from common.sampling_params import SamplingParams

    rng = random.Random(0)
    count, lo, hi, top_id = (8, 5, 30, 1000) if smoke else (256, 100, 1024, 10000)
    prompts = [[rng.randint(0, top_id) for _ in range(rng.randint(lo, hi))] for _ in range(count)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(lo, hi))
        for _ in range(count)
    ]
    return prompts, params


def phase_throughput(work: Path, smoke: bool, report: Report) -> bool:
    from common.sampling_params import SamplingParams

    prompts, params = nano_vllm_workload(smoke)
    started = time.perf_counter()
    options = dict(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    if smoke:
        options = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    llm = _llm(work, **options, overlap=True if smoke else None)
    runner = llm.engine.runner
    if not _cuda():
        runner.use_decode_graphs(capture=False)
    report.set(
        init_s=round(time.perf_counter() - started, 1),
        num_kv_blocks=runner.num_blocks,
        options=options,
        hf_generate_batch_tok_s=HF_GENERATE_BATCH_TOK_S,
        target_tok_s=25000,
    )
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    steps = StepTimes(runner)
    replays = runner.graphs.num_replays if runner.graphs else 0
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    out_tokens = sum(len(o.token_ids) for o in outs)
    report.set(
        requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=out_tokens,
        seconds=round(seconds, 2),
        output_tok_s=round(out_tokens / seconds, 1),
        graph_steps=(runner.graphs.num_replays - replays) if runner.graphs else 0,
        preemptions=llm.engine.scheduler.num_preemptions,
        **steps.summary(),
    )
    if llm.engine.overlap:  # the same engine, drained, with its loop serial: what overlap buys
        llm.engine.overlap = False
        started = time.perf_counter()
        serial = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        llm.engine.overlap = True
        serial_tokens = sum(len(o.token_ids) for o in serial)
        report.set(overlap=True, serial_loop_output_tok_s=round(serial_tokens / seconds, 1))
    print("throughput:", {k: v for k, v in report.data.items() if k != "records"})
    return out_tokens == sum(p.max_tokens for p in params)


# -- kernel timing ---------------------------------------------------------------------------------


def phase_timing(work: Path, smoke: bool, report: Report) -> bool:
    """Each kernel as the model calls it (kernels.dispatch: triton on CUDA), against the time its
    bytes take at the measured device copy bandwidth."""
    from kernels import dispatch
    from kernels.rotary import rope_cos_sin, rope_inv_freq

    dev, dtype = _device(), _dtype()
    elem = torch.tensor([], dtype=dtype).element_size()
    bandwidth = copy_bandwidth(64 * 1024**2 if smoke else 2 * 1024**3)
    report.set(
        copy_gb_s=round(bandwidth / 1e9, 1),
        backend=dispatch.backend_for(torch.empty(1, dtype=dtype, device=dev)),
    )
    gen = torch.Generator(dev).manual_seed(0)
    num_q, num_kv, head_dim, hidden, bs = (4, 2, 32, 64, 16) if smoke else (16, 8, 128, 1024, 16)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    def record(name: str, nbytes: int, fn: Callable[[], object], **shape) -> None:
        seconds = bench(fn, iters=3 if smoke else 50)
        floor = nbytes / bandwidth
        report.add(
            kernel=name,
            **shape,
            us=round(seconds * 1e6, 2),
            floor_us=round(floor * 1e6, 2),
            of_floor=round(floor / seconds, 3),
            gb_s=round(nbytes / seconds / 1e9, 1),
        )
        print("timing:", report.data["records"][-1])

    ctx = 64 if smoke else 1024
    for batch in (1, 4) if smoke else (1, 64, 256):
        for width_from in ("context", "max_model_len_2048"):
            width = -(-ctx // bs) if width_from == "context" else -(-2048 // bs)
            blocks = batch * width + 1
            kc, vc = randn(blocks, bs, num_kv, head_dim), randn(blocks, bs, num_kv, head_dim)
            tables = torch.randperm(blocks, generator=gen, device=dev)[: batch * width]
            tables = tables.view(batch, width)
            lens = torch.full((batch,), ctx, device=dev)
            q = randn(batch, num_q, head_dim)
            nbytes = (2 * batch * ctx * num_kv + 2 * batch * num_q) * head_dim * elem
            record(
                "paged_decode_attention",
                nbytes,
                lambda q=q, kc=kc, vc=vc, t=tables, n=lens: dispatch.paged_decode_attention(
                    q, kc, vc, t, n, 0.1
                ),
                batch=batch,
                context=ctx,
                table_width_from=width_from,
            )
    # Mixed context lengths, as in the nano-vllm workload (uniform 100-2048): whole-context
    # programs leave the longest rows as a tail, which split-K could even out.
    lo, hi = (8, 64) if smoke else (100, 2048)
    for batch in (4, 8) if smoke else (64, 256):
        lens = torch.randint(lo, hi + 1, (batch,), generator=gen, device=dev)
        width = -(-hi // bs)
        blocks = batch * width + 1
        kc, vc = randn(blocks, bs, num_kv, head_dim), randn(blocks, bs, num_kv, head_dim)
        tables = torch.randperm(blocks, generator=gen, device=dev)[: batch * width]
        tables = tables.view(batch, width)
        q = randn(batch, num_q, head_dim)
        nbytes = (2 * int(lens.sum()) * num_kv + 2 * batch * num_q) * head_dim * elem
        splits_tried = [None] if dispatch.backend_for(q) != "triton" else [None, 2, 4, 8]
        for splits in splits_tried:
            from kernels import triton_attention as ta

            def fn(q=q, kc=kc, vc=vc, t=tables, n=lens, s=splits):
                if s is None:  # the launch heuristic, as the model calls it
                    return dispatch.paged_decode_attention(q, kc, vc, t, n, 0.1)
                return ta.paged_decode_attention(q, kc, vc, t, n, 0.1, num_splits=s)

            record(
                "paged_decode_attention_mixed",
                nbytes,
                fn,
                batch=batch,
                context=f"uniform {lo}-{hi}",
                num_splits=splits or "auto",
            )
    for tokens in (1, 256) if smoke else (1, 256, 4096):
        x, res, w = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        record(
            "rms_norm",
            (2 * tokens + 1) * hidden * elem,
            lambda x=x, w=w: dispatch.rms_norm(x, w, 1e-6),
            tokens=tokens,
        )
        record(
            "add_rms_norm",
            (4 * tokens + 1) * hidden * elem,
            lambda x=x, r=res, w=w: dispatch.add_rms_norm(x, r, w, 1e-6),
            tokens=tokens,
        )
        qk = randn(tokens, num_q, head_dim)
        record(
            "qk_rms_norm",
            (2 * tokens * num_q + 1) * head_dim * elem,
            lambda x=qk, w=randn(head_dim): dispatch.rms_norm(x, w, 1e-6),
            tokens=tokens,
        )
        cos, sin = rope_cos_sin(rope_inv_freq(head_dim, 1e6, None), 4096)
        pos = torch.randint(0, 4096, (tokens,), generator=gen, device=dev)
        cos, sin = cos.to(dev)[pos].to(dtype), sin.to(dev)[pos].to(dtype)
        q, k = randn(tokens, num_q, head_dim), randn(tokens, num_kv, head_dim)
        record(
            "apply_rotary",
            (2 * (num_q + num_kv) + 2) * tokens * head_dim * elem,
            lambda q=q, k=k, c=cos, s=sin: dispatch.apply_rotary(q, k, c, s),
            tokens=tokens,
        )
        # Qwen3's q/k norm and rotary: one launch against the three it replaced.
        qw, kw = randn(head_dim), randn(head_dim)
        nbytes = (2 * (num_q + num_kv) + 2) * tokens * head_dim * elem

        def chain(q=q, k=k, c=cos, s=sin, qw=qw, kw=kw):
            q, k = dispatch.rms_norm(q, qw, 1e-6), dispatch.rms_norm(k, kw, 1e-6)
            return dispatch.apply_rotary(q, k, c, s)

        record("qk_norm_then_rotary_3_launches", nbytes, chain, tokens=tokens)
        record(
            "qk_norm_rotary",
            nbytes,
            lambda q=q, k=k, c=cos, s=sin, qw=qw, kw=kw: dispatch.qk_norm_rotary(
                q, k, qw, kw, 1e-6, c, s
            ),
            tokens=tokens,
        )
    # The gated MLP's activation: one pass against torch's silu then mul.
    from kernels import activation as ref_act

    for tokens in (1, 8) if smoke else (1, 256, 4096):
        gate_up = randn(tokens, 2 * (96 if smoke else 3072))
        nbytes = 3 * tokens * gate_up.shape[1] // 2 * elem
        record("silu_and_mul", nbytes, lambda x=gate_up: dispatch.silu_and_mul(x), tokens=tokens)
        record(
            "silu_then_mul_torch", nbytes, lambda x=gate_up: ref_act.silu_and_mul(x), tokens=tokens
        )
    # The sampler's race: the fused kernel against the materialised noise it replaced on CUDA.
    from services.worker.sampling_noise import noise_rows

    vocab = 3000 if smoke else 151936
    for rows in (1, 8) if smoke else (1, 256):
        probs = torch.rand(rows, vocab, generator=gen, device=dev)
        keys = torch.randint(0, 2**62, (rows,), generator=gen, device=dev)
        fused = dispatch.race_sample(probs, keys)
        if fused is not None:
            record(
                "race_sample",
                rows * vocab * 4,
                lambda p=probs, k=keys: dispatch.race_sample(p, k),
                rows=rows,
                vocab=vocab,
            )
        record(
            "race_materialised_noise",
            rows * vocab * 4,
            lambda p=probs, k=keys: (p / noise_rows(k, p.shape[-1])).max(dim=-1).indices,
            rows=rows,
            vocab=vocab,
        )
    return True


# -- engine paths ----------------------------------------------------------------------------------


def phase_paths(work: Path, smoke: bool, report: Report) -> bool:
    """The engine's other paths on the device, each against a plain greedy run in float32 (bf16
    logits differ between kernels, so only float32 makes token equality a fair check): n-gram
    speculation (verify rows through the varlen kernel), prefix caching (a shared prefix, run
    twice), and preemption (a KV cache too small for the batch)."""
    from common.sampling_params import SamplingParams

    vocab = json.loads((_model_path(work) / "config.json").read_text())["vocab_size"]
    rng = random.Random(3)
    shared = [rng.randrange(3, vocab) for _ in range(40 if smoke else 300)]
    motif = [rng.randrange(3, vocab) for _ in range(8 if smoke else 48)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(5 + i)] for i in range(4)]
    prompts += [motif * 3 + [rng.randrange(3, vocab)] for _ in range(4)]  # copy-heavy
    new = 16 if smoke else 96
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    base = dict(dtype="float32", max_model_len=128 if smoke else 1024, max_num_seqs=8)

    def run(label: str, repeat: int = 1, **options) -> tuple[list[list[int]], object]:
        llm = _llm(work, **(base | options))
        if not _cuda():
            llm.engine.runner.use_decode_graphs(capture=False)
        started = time.perf_counter()
        for _ in range(repeat):
            outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        stats = llm.engine.scheduler
        record = dict(
            path=label,
            seconds=round(seconds, 2),
            preemptions=stats.num_preemptions,
            prefix_hit_tokens=stats.prefix_hits,
        )
        if stats.spec is not None:
            spec = stats.spec.stats
            record.update(draft_tokens=spec.draft_tokens, accepted_tokens=spec.accepted_tokens)
        del llm
        _free()
        return [o.token_ids for o in outs], record

    want, record = run("plain", enable_prefix_caching=False)
    report.add(**record)
    ok = True
    block = 16
    per_request = -(-(len(prompts[0]) + new) // block)
    variants = [
        ("ngram", dict(enable_prefix_caching=False, speculative="ngram")),
        ("prefix_cache_twice", dict(enable_prefix_caching=True, repeat=2)),
        ("preempt", dict(enable_prefix_caching=False, num_kv_blocks=per_request * 3)),
    ]
    for label, options in variants:
        got, record = run(label, **options)
        same = [g == w for g, w in zip(got, want)]
        record["identical_requests"] = sum(same)
        record["requests"] = len(same)
        if label == "ngram":
            record["ok"] = all(same) and record["accepted_tokens"] > 0
        elif label == "preempt":
            record["ok"] = all(same) and record["preemptions"] > 0
        elif label == "prefix_cache_twice":
            record["ok"] = all(same) and record["prefix_hit_tokens"] > 0
        ok = ok and record["ok"]
        report.add(**record)
        print("paths:", record)
    return ok


# -- profile -------------------------------------------------------------------------------------


def phase_profile(work: Path, smoke: bool, report: Report) -> bool:
    """Where the time goes, for the next optimisation to aim at: torch.profiler's top kernels by
    device time over batch-1 greedy decode (the CUDA-graph path) and over a slice of the nano-vllm
    workload, and cProfile's top functions over eager batch-1 forwards (the host cost of a
    launch-bound step). Each table goes to the log and to WORK/profile_NAME.txt."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from common.sampling_params import SamplingParams
    from services.worker.step_inputs import Chunk

    on_cuda = _cuda()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    if on_cuda and not hasattr(torch.autograd.profiler_util.FunctionEventAvg(), sort):
        sort = "self_cuda_time_total"  # the older name

    def save(name: str, text: str) -> None:
        (work / f"profile_{name}.txt").write_text(text)
        print(f"== profile {name}\n{text}")

    def top(prof, name: str, **extra) -> None:
        events = prof.key_averages()
        save(name, events.table(sort_by=sort, row_limit=30, max_name_column_width=80))
        rows = sorted(events, key=lambda e: getattr(e, sort), reverse=True)[:30]
        report.add(
            profile=name,
            **extra,
            top=[
                dict(name=e.key[:120], calls=e.count, self_device_us=round(getattr(e, sort)),
                     self_cpu_us=round(e.self_cpu_time_total))
                for e in rows
            ],
        )  # fmt: skip

    vocab = json.loads((_model_path(work) / "config.json").read_text())["vocab_size"]
    prompt = [random.Random(2).randrange(3, vocab) for _ in range(16 if smoke else 128)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    new = 8 if smoke else 64

    llm = _llm(work, max_model_len=2048, max_num_seqs=1, num_kv_blocks=256)
    runner = llm.engine.runner
    if not on_cuda:
        runner.use_decode_graphs(capture=False)
    llm.generate([prompt], SamplingParams(max_tokens=16, **greedy), use_tqdm=False)  # warm-up
    with profile(activities=activities) as prof:
        llm.generate([prompt], SamplingParams(max_tokens=new, **greedy), use_tqdm=False)
    top(prof, "decode_batch1", new_tokens=new)

    # Eager launches, the graph set aside: what each step costs the host.
    graphs, runner.graphs = runner.graphs, None
    blocks = list(range(-(-(len(prompt) + 1) // runner.block_size)))
    forward = _batch1_forward(runner, Chunk([5], len(prompt), blocks, 1), _device())
    calls = 3 if smoke else 20
    with torch.inference_mode():
        forward()
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        for _ in range(calls):
            forward()
        if on_cuda:
            torch.cuda.synchronize()
        profiler.disable()
        eager_ms = (time.perf_counter() - started) / calls * 1e3
    runner.graphs = graphs
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    save("eager_host", f"{calls} eager batch-1 forwards, {eager_ms:.2f} ms each\n{text.getvalue()}")
    report.set(eager_forward_ms_under_cprofile=round(eager_ms, 2))
    del llm, runner, graphs
    _free()

    prompts, params = nano_vllm_workload(smoke)
    count = 8 if smoke else 128
    cap = 8 if smoke else 128
    params = [
        SamplingParams(
            temperature=sp.temperature, ignore_eos=True, max_tokens=min(sp.max_tokens, cap)
        )
        for sp in params[:count]
    ]
    options = dict(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    if smoke:
        options = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    llm = _llm(work, **options)
    if not on_cuda:
        llm.engine.runner.use_decode_graphs(capture=False)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    steps = StepTimes(llm.engine.runner)
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        outs = llm.generate(prompts[:count], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    top(prof, "throughput_slice", requests=count, output_tokens=tokens,
        seconds_under_profiler=round(seconds, 2), **steps.summary())  # fmt: skip

    # The same slice under cProfile alone: which host functions a step's wall time goes to.
    steps.reset()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    outs = llm.generate(prompts[:count], params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - started
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    summary = steps.summary()
    save(
        "host_throughput_slice", f"{count} requests, {seconds:.2f} s, {summary}\n{text.getvalue()}"
    )
    report.set(host_slice_seconds_under_cprofile=round(seconds, 2), host_slice_steps=summary)
    return True


# -- serve ---------------------------------------------------------------------------------------


def _http_json(url: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def phase_serve(work: Path, smoke: bool, report: Report) -> bool:
    """The whole service set on the device: api, tokenizer, scheduler and worker as their own
    processes over ZMQ, driven over HTTP by `stoker bench serve` (aiohttp), through
    benchmarks/serving.py's server handle."""
    from serving import Server, bench, metric_sum

    vocab = json.loads((_model_path(work) / "config.json").read_text())["vocab_size"]
    flags = ["--device", str(_device()), "--dtype", _dtype_name(), "--max-model-len", "1024"]
    if smoke:
        flags += ["--max-num-seqs", "8"]
    server = Server(str(_model_path(work)), flags, log=work / "serve.log")
    try:
        report.set(ready_s=round(server.ready_s, 1))
        base = f"http://127.0.0.1:{server.port}"
        one = _http_json(
            base + "/v1/completions",
            dict(prompt="w5 w6 w7", max_tokens=8, temperature=0, ignore_eos=True),
        )
        report.set(completion=one["choices"][0]["text"], usage=one.get("usage"))
        count, streams = (8, 4) if smoke else (512, 128)
        result = bench(server, [
            "--random-input-len", "128", "--random-output-len", "128", "--num-prompts",
            str(count), "--max-concurrency", str(streams), "--metric-percentiles", "50,99",
            "--random-vocab-size", str(vocab),
        ])  # fmt: skip
        report.set(bench=result)
        for _ in range(50):  # the scheduler's stats reach the api on its next report
            metrics = server.metrics()
            free = metric_sum(metrics, "stoker:kv_cache_free_blocks")
            total = metric_sum(metrics, "stoker:kv_cache_total_blocks")
            if free == total:
                break
            time.sleep(0.1)
        report.set(kv_free_blocks=free, kv_total_blocks=total)
        print("serve:", {k: v for k, v in report.data.items() if k != "records"})
        return result.get("completed") == count and free == total
    finally:
        server.stop()


# -- driver ----------------------------------------------------------------------------------------


def merge(work: Path, out: Path) -> int:
    """Every phase's JSON and exit status in one file; exit 0 only if every phase passed."""
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}}
    all_ok = True
    for phase in PHASES:
        path, rc_path = work / f"{phase}.json", work / f"{phase}.rc"
        data = json.loads(path.read_text()) if path.is_file() else {"ok": None}
        status = rc_path.read_text().split() if rc_path.is_file() else ["not-run", "0"]
        data["exit"], data["wall_s"] = status[0], float(status[1])
        if status[0] == "124":
            data["timed_out"] = True
        all_ok = all_ok and data.get("ok") is True
        summary["phases"][phase] = data
    summary["ok"] = all_ok
    out.write_text(json.dumps(summary, indent=1, default=str))
    for phase, data in summary["phases"].items():
        print(f"{phase:11s} ok={data.get('ok')} exit={data['exit']} wall={data['wall_s']:.0f}s")
    return 0 if all_ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("phase", choices=[*PHASES, "merge"])
    ap.add_argument("--work", type=Path, required=True, help="model folder and per-phase JSON")
    ap.add_argument("--out", type=Path, help="merge: the combined JSON")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.phase == "merge":
        return merge(args.work, args.out or args.work / "gpu_check.json")
    if not _cuda() and not args.smoke:
        print("gpu_check: no CUDA device; use --smoke for the CPU check", file=sys.stderr)
        return 2
    if not _cuda():
        torch.set_num_threads(1)  # tiny shapes: threads only add barrier waits on a busy box
    report = Report(args.work / f"{args.phase}.json", args.phase, args.smoke)
    run = globals()[f"phase_{args.phase}"]
    try:
        ok = run(args.work, args.smoke, report)
    except Exception as e:
        traceback.print_exc()
        report.set(error=f"{type(e).__name__}: {e}")
        ok = False
    report.set(ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
