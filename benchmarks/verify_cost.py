"""What a speculative verify costs against one decode step: the GEMMs alone, then the whole
worker step.

A verify of k drafts runs the target over k + 1 rows of one request. Where the linear layers are
bound by reading the weights, k + 1 rows cost about what one row costs, and speculation pays
nearly its acceptance length. Where they are bound by arithmetic, the cost grows with the rows.
This times the model's linear layers (oneDNN-packed float32, as the worker runs them) at 1 to 8
rows for a model's shapes, with random weights (the time depends on the shapes only), and reports
the cost relative to one row, the achieved GFLOP/s and GB/s of weights read, and what one draft
step of an EAGLE head costs with the full-vocabulary LM head and with a reduced draft vocabulary
(--draft-vocab, `stoker train-draft`'s default 8192).

Then the whole worker step, on the real weights: one request decoding (1 row) against the same
request verifying 4 n-gram drafts (5 rows; a repeating prompt keeps the n-gram proposing 4,
non-adaptive), each split into the worker's prepare, forward and sample times.

    .venv/bin/python benchmarks/verify_cost.py --model smollm2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_utils import write_result  # noqa: E402

from stoker.common.model_config import ModelConfig  # noqa: E402
from stoker.common.model_registry import resolve_model  # noqa: E402
from stoker.services.worker.models.layers import linear, pack_weights  # noqa: E402


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's fused linear weights, as the worker packs them."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    return [
        (q + 2 * kv, cfg.hidden_size),  # fused q/k/v
        (cfg.hidden_size, q),  # o
        (2 * cfg.intermediate_size, cfg.hidden_size),  # fused gate/up
        (cfg.hidden_size, cfg.intermediate_size),  # down
    ]


def _time(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def engine_steps(model: str, steps: int) -> dict:
    """Median worker prepare / forward / sample seconds of decode and 5-row verify steps."""
    from stoker.common.config import EngineConfig
    from stoker.common.sampling_params import SamplingParams
    from stoker.services.engine.core import EngineCore

    out = {}
    for mode, spec in (("decode", None), ("verify", "ngram")):
        core = EngineCore(
            EngineConfig(
                model=model, speculative=spec, num_speculative_tokens=4,
                speculative_adaptive=False, max_model_len=1024,
            )
        )  # fmt: skip
        core.add_request("r", list(range(100, 132)) * 4, SamplingParams(max_tokens=steps + 8))
        runner, sched, times = core.runner, core.scheduler, []
        t0, num_steps = time.perf_counter(), 0
        while sched.has_unfinished():
            num_steps += 1
            plan = sched.schedule()
            result = runner.execute(plan)
            sched.update(plan, result)
            if result.num_tokens == (1 if spec is None else 5):
                times.append((result.prepare_s, result.forward_s, result.sample_s))
        wall = time.perf_counter() - t0
        if not times:
            raise SystemExit(f"no {mode} steps of the expected shape")
        mid = sorted(times, key=sum)[len(times) // 2]
        out[mode] = {
            "steps": len(times),
            "prepare_ms": round(mid[0] * 1e3, 2),
            "forward_ms": round(mid[1] * 1e3, 2),
            "sample_ms": round(mid[2] * 1e3, 2),
            "total_ms": round(sum(mid) * 1e3, 2),
            "engine_tok_s": round((steps + 8) / wall, 2),  # prefill included, in-process
            "tokens_per_step": round((steps + 8) / num_steps, 2),
        }
    out["verify_vs_decode"] = round(out["verify"]["total_ms"] / out["decode"]["total_ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--engine-steps", type=int, default=120, help="0: GEMMs only")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="a reduced EAGLE vocabulary")
    args = ap.parse_args()
    cfg = ModelConfig.from_folder(resolve_model(args.model))
    torch.manual_seed(0)
    layers = [
        pack_weights([torch.randn(o, i) for o, i in layer_shapes(cfg)])
        for _ in range(cfg.num_layers)
    ]
    head = pack_weights([torch.randn(cfg.vocab_size, cfg.hidden_size)])[0]
    layer_params = sum(o * i for o, i in layer_shapes(cfg)) * cfg.num_layers
    head_params = cfg.vocab_size * cfg.hidden_size

    def body(inputs: dict[int, torch.Tensor]) -> None:
        for weights in layers:
            for w in weights:
                linear(inputs[w.size(1)], w)  # the output is discarded

    widths = {i for _, i in layer_shapes(cfg)}
    rows_out = []
    for m in args.rows:
        inputs = {i: torch.randn(m, i) for i in widths}
        xh = torch.randn(m, cfg.hidden_size)
        body_s = _time(lambda inputs=inputs: body(inputs), args.repeat)
        head_s = _time(lambda xh=xh: linear(xh, head), args.repeat)
        total = body_s + head_s
        flops = 2 * m * (layer_params + head_params)
        rows_out.append({
            "rows": m,
            "layers_ms": round(body_s * 1e3, 2),
            "lm_head_ms": round(head_s * 1e3, 2),
            "total_ms": round(total * 1e3, 2),
            "gflops": round(flops / total / 1e9, 1),
            "weight_gbps": round(4 * (layer_params + head_params) / total / 1e9, 1),
        })  # fmt: skip
    one = rows_out[0]["total_ms"]
    for r in rows_out:
        r["vs_one_row"] = round(r["total_ms"] / one, 2)
    # One EAGLE draft step: one decoder layer and the full LM head, at one row; then with the
    # LM head cut to the draft vocabulary's rows.
    layer_ms = rows_out[0]["layers_ms"] / cfg.num_layers
    draft_ms = layer_ms + rows_out[0]["lm_head_ms"]
    draft_rows = torch.randn(min(args.draft_vocab, cfg.vocab_size), cfg.hidden_size)
    small_head = pack_weights([draft_rows])[0]
    x1 = torch.randn(1, cfg.hidden_size)
    reduced_ms = layer_ms + _time(lambda: linear(x1, small_head), args.repeat) * 1e3
    result = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "weights_mb": round(4 * (layer_params + head_params) / 1e6, 1),
        "rows": rows_out,
        "eagle_draft_step_ms": round(draft_ms, 2),
        "eagle_draft_step_vs_decode": round(draft_ms / one, 3),
        "draft_vocab": args.draft_vocab,
        "eagle_reduced_draft_step_ms": round(reduced_ms, 2),
        "eagle_reduced_draft_step_vs_decode": round(reduced_ms / one, 3),
    }
    print(f"{args.model}: {result['weights_mb']} MB of linear weights, {result['threads']} threads")
    print("rows  layers ms  lm_head ms  total ms  x one row  GFLOP/s  weight GB/s")
    for r in rows_out:
        print(
            f"{r['rows']:4d} {r['layers_ms']:10.2f} {r['lm_head_ms']:11.2f} {r['total_ms']:9.2f}"
            f" {r['vs_one_row']:10.2f} {r['gflops']:8.1f} {r['weight_gbps']:12.1f}"
        )
    print(
        f"one EAGLE draft step (1 layer + full LM head, 1 row): {draft_ms:.2f} ms = "
        f"{result['eagle_draft_step_vs_decode']:.2f} of a decode step's GEMMs"
    )
    print(
        f"with a {args.draft_vocab}-token draft vocabulary: {reduced_ms:.2f} ms = "
        f"{result['eagle_reduced_draft_step_vs_decode']:.2f}"
    )
    if args.engine_steps:
        del layers, head  # free the random weights before loading the real ones
        result["engine"] = e = engine_steps(str(resolve_model(args.model)), args.engine_steps)
        for mode in ("decode", "verify"):
            r = e[mode]
            print(
                f"worker {mode} step ({r['steps']} steps): prepare {r['prepare_ms']} ms, forward "
                f"{r['forward_ms']} ms, sample {r['sample_ms']} ms, total {r['total_ms']} ms; "
                f"in-process engine {r['engine_tok_s']} tok/s, {r['tokens_per_step']} tokens/step"
            )
        print(f"a 5-row verify step costs {e['verify_vs_decode']}x a decode step")
    print("wrote", write_result("verify_cost", result))


if __name__ == "__main__":
    main()
