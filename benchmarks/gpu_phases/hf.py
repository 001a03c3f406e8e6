"""hf: greedy agreement with HF transformers in the same dtype (bf16 on the GPU), judged at a
tolerance on logits: stoker may pick another token than HF only where HF's top-2 logit margin is
within twice the measured logit error there (a perturbation of at most e per logit cannot flip
a wider margin)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from gpu_phases.shared import Report, cuda, device, dtype, free, llm, model_path, vocab_size


def _hf_greedy(work: Path, prompts: list[list[int]], new: int):
    """HF's greedy tokens for each prompt, and its teacher-forced logits at every position."""
    from transformers import AutoModelForCausalLM

    dev = device()
    hf = AutoModelForCausalLM.from_pretrained(model_path(work), dtype=dtype()).to(dev).eval()
    tokens, logits = [], []
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
            tokens.append(out[0, len(prompt) :].tolist())
            logits.append(hf(out).logits[0].float().cpu())  # teacher-forced, every position
    del hf
    free()
    return tokens, logits


def _stoker_logits(runner, seq: list[int]) -> torch.Tensor:
    """stoker's logits at every position of `seq`, one prefill through the engine's model."""
    from stoker.services.worker.step_inputs import Chunk, build_step_inputs

    chunk = Chunk(seq, 0, list(range(-(-len(seq) // runner.block_size))), len(seq))
    with torch.inference_mode():
        inputs = build_step_inputs([chunk], runner.block_size, device())
        model = runner.model
        hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        return model.compute_logits(hidden[inputs.sample_rows]).float().cpu()


def _judge(prompt, want_tokens, want_logits, got_logits, out, new) -> dict:
    """One prompt's record: teacher-forced agreement, and where free-running generation first
    diverged, whether HF's margin there was within the error bound."""
    err = (got_logits - want_logits).abs().max(dim=-1).values  # per position
    top2 = want_logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    agree = got_logits.argmax(-1) == want_logits.argmax(-1)
    unexplained = int((~agree & (margin > 2 * err)).sum())
    # Free-running generation (decode steps through the CUDA-graph path): first divergence.
    first = next((i for i, (a, b) in enumerate(zip(out.token_ids, want_tokens)) if a != b), None)
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
    record["ok"] = unexplained == 0 and diverged_ok
    return record


def run(work: Path, smoke: bool, report: Report) -> bool:
    from stoker.common.sampling_params import SamplingParams

    vocab = vocab_size(work)
    rng = random.Random(1)
    lengths, new = ((5, 12, 30), 8) if smoke else ((17, 64, 100, 128), 32)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    hf_tokens, hf_logits = _hf_greedy(work, prompts, new)

    engine = llm(
        work,
        max_model_len=2048,
        max_num_seqs=8,
        enable_prefix_caching=False,  # the teacher-forced pass below reuses free blocks
        **({"gpu_memory_utilization": 0.3} if cuda() else {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=1)
    outs = engine.generate(prompts, params, use_tqdm=False)
    ok = True
    for prompt, want_tokens, want_logits, out in zip(prompts, hf_tokens, hf_logits, outs):
        got_logits = _stoker_logits(engine.engine.runner, prompt + want_tokens)
        record = _judge(prompt, want_tokens, want_logits, got_logits, out, new)
        ok = ok and record["ok"]
        report.add(**record)
        print("hf:", record)
    return ok
