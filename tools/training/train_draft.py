"""`stoker train-draft`: distil a small Llama draft model from a target model folder.

    stoker train-draft --target models/stoker-tiny --out /tmp/draft --corpus corpus.txt

Generates greedy continuations of prompts with stoker's engine, trains the draft on KL to the
target's distribution over those and over corpus text, and writes a transformers-loadable
folder (config, safetensors, the target's tokenizer files, README with the measured top-1
agreement and expected acceptance length). Interrupted runs resume from `--out/checkpoint`.

`--method eagle` trains an EAGLE head over the target's hidden states instead
(tools/training/eagle.py); `--method distill` (the default) is the above.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

PROG = "stoker train-draft"
DEFAULT_LR = 2e-3  # distill's; eagle has its own unless --lr is given


class UsageError(Exception):
    """A problem with the command line or its inputs, reported without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, type=Path, help="target model folder (HF format)")
    p.add_argument("--out", required=True, type=Path, help="output folder (resumed if present)")
    p.add_argument(
        "--method",
        choices=("distill", "eagle"),
        default="distill",
        help="distill: an independent small draft model (default); eagle: an EAGLE head over "
        "the target's hidden states (tools/training/eagle.py)",
    )
    p.add_argument("--head-layers", type=int, default=1, help="eagle: decoder layers (default 1)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="--prompts lines are user turns: apply the chat template",
    )
    p.add_argument(
        "--device", default="auto", help="eagle and --self-chat: device (default: cuda if any)"
    )
    p.add_argument("--head-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="eagle: draft over the target's N most frequent tokens (EAGLE-3's reduced "
        "vocabulary; a cheaper LM head per draft step); 0: every token (default 8192)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", type=Path, help="UTF-8 text: prompts, training text, held-out")
    src.add_argument("--prompts", type=Path, help="a text file with one prompt per line")
    src.add_argument(
        "--self-chat",
        action="store_true",
        help="the target writes --num-prompts user turns itself, sampled from its chat "
        "template's user prefix (tools/training/self_chat.py); needs a chat template",
    )
    p.add_argument("--layers", type=int, default=2, help="draft layers (default 2)")
    p.add_argument("--hidden", type=int, help="draft width (default: half the target's)")
    p.add_argument("--minutes", type=float, default=10.0, help="training time cap (default 10)")
    p.add_argument("--steps", type=int, help="exact number of steps (instead of --minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=512, help="continuations to generate")
    p.add_argument("--prompt-tokens", type=int, default=32, help="corpus prompt length")
    p.add_argument("--gen-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--generator", choices=("stoker", "transformers"), default="stoker")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    p.add_argument("--keep-checkpoint", action="store_true")
    return p


def _check_target(target: Path) -> dict:
    if not target.is_dir():
        raise UsageError(f"--target {target}: not a folder")
    config_path = target / "config.json"
    if not config_path.is_file():
        raise UsageError(f"--target {target}: no config.json (expected a transformers folder)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"--target {target}: config.json is not valid JSON: {e}") from e
    if not any((target / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise UsageError(f"--target {target}: no tokenizer (tokenizer.json or tokenizer.model)")
    if not any(target.glob("*.safetensors")) and not any(target.glob("*.bin")):
        raise UsageError(f"--target {target}: no weights (*.safetensors)")
    for key in ("vocab_size", "hidden_size"):
        if not isinstance(config.get(key), int):
            raise UsageError(f"--target {target}: config.json lacks {key}")
    return config


def _check_args(args: argparse.Namespace) -> dict:
    config = _check_target(args.target)
    for name in ("corpus", "prompts"):
        path = getattr(args, name)
        if path is not None and (not path.is_file() or path.stat().st_size == 0):
            raise UsageError(f"--{name} {path}: not a non-empty file")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a folder")
    if args.out.resolve() == args.target.resolve():
        raise UsageError("--out must differ from --target")
    positive = ("layers", "num_prompts", "prompt_tokens", "gen_tokens", "batch_size")
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.hidden is not None and (args.hidden < 64 or args.hidden % 64):
        raise UsageError("--hidden must be a positive multiple of 64")
    if args.minutes <= 0 or (args.steps is not None and args.steps < 1):
        raise UsageError("--minutes and --steps must be positive")
    max_len = config.get("max_position_embeddings") or 2048
    if args.prompt_tokens + args.gen_tokens > max_len:
        raise UsageError(
            f"--prompt-tokens + --gen-tokens = {args.prompt_tokens + args.gen_tokens} exceeds "
            f"the target's max_position_embeddings {max_len}"
        )
    return config


def _encode(tok: object, text: str) -> list[int]:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizer: no max-length warnings on long text
        return backend.encode(text, add_special_tokens=False).ids
    return tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


def _read_prompts(path: Path, tok: object, bos: int | None, limit: int) -> list[list[int]]:
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    prompts = []
    for line in lines:
        ids = _encode(tok, line.replace("\\n", "\n"))[-limit:]
        prompts.append(([bos] if bos is not None else []) + ids)
    if len(prompts) < 2:
        raise UsageError(f"--prompts {path}: need at least 2 prompts")
    return prompts


def _read_chat_prompts(path: Path, tok: object) -> list[list[int]]:
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not getattr(tok, "chat_template", None):
        raise UsageError("--chat: the target's tokenizer has no chat template")
    prompts = chat_prompt_ids(tok, [line.replace("\\n", "\n") for line in lines])
    if len(prompts) < 2:
        raise UsageError(f"--prompts {path}: need at least 2 prompts")
    return prompts


def chat_prompt_ids(tok: object, turns: list[str]) -> list[list[int]]:
    """Each user turn through the chat template, ready for the assistant's answer."""
    prompts = []
    for text in turns:
        turn = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(turn, add_generation_prompt=True)  # type: ignore[attr-defined]
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def _self_chat_prompts(args: argparse.Namespace, tok: object) -> list[list[int]]:
    from stoker.tools.training.eagle import resolve_device
    from stoker.tools.training.self_chat import self_chat_turns

    if not getattr(tok, "chat_template", None):
        raise UsageError("--self-chat: the target's tokenizer has no chat template")
    if args.num_prompts < 2:
        raise UsageError("--self-chat needs --num-prompts of at least 2")
    device = resolve_device(args.device).type
    try:
        turns = self_chat_turns(args.target, args.num_prompts, seed=args.seed, device=device)
    except ValueError as e:
        raise UsageError(f"--self-chat: {e}") from e
    print(f"the target wrote {len(turns)} user turns")
    return chat_prompt_ids(tok, turns)


def run(args: argparse.Namespace) -> int:
    config = _check_args(args)
    import torch

    from stoker.tools.training import card, distill

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(args.target)
    except Exception as e:  # noqa: BLE001 - any failure means the folder is unusable
        raise UsageError(f"--target {args.target}: tokenizer does not load: {e}") from e
    out: Path = args.out
    has_tokenizer = any((out / n).exists() for n in ("tokenizer.json", "tokenizer.model"))
    if has_tokenizer and not distill.same_tokenizer(args.target, out):
        raise UsageError(
            f"--out {out} holds a different tokenizer than --target {args.target}; "
            "a draft must share its target's tokenizer: choose a new --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    distill.copy_tokenizer(args.target, out)

    bos = config.get("bos_token_id")
    corpus = heldout = None
    if args.corpus is not None:
        text = args.corpus.read_text(encoding="utf-8")
        cut = text.find("\n", int(len(text) * 0.95))
        cut = cut if cut > 0 else len(text)
        corpus = torch.tensor(_encode(tok, text[:cut]))
        heldout = torch.tensor(_encode(tok, text[cut:])) if cut < len(text) else None
        need = args.prompt_tokens + args.gen_tokens
        if corpus.numel() <= need:
            raise UsageError(f"--corpus {args.corpus}: too short ({corpus.numel()} tokens)")
        prompts = distill.corpus_prompts(
            corpus, args.num_prompts, args.prompt_tokens, bos or 0, args.seed
        )
    elif args.self_chat:
        prompts = _self_chat_prompts(args, tok)
    elif args.prompts is not None and args.chat:
        prompts = _read_chat_prompts(args.prompts, tok)
    elif args.prompts is not None:
        prompts = _read_prompts(args.prompts, tok, bos, args.prompt_tokens)
    else:  # no text at all: <bos> and one random token, continued greedily by the target
        gen = torch.Generator().manual_seed(args.seed)
        firsts = torch.randint(0, len(tok), (args.num_prompts,), generator=gen).tolist()
        prompts = [([bos] if bos is not None else []) + [t] for t in firsts]

    if args.method == "eagle":
        return _run_eagle(args, prompts)
    cfg = distill.DistillConfig(
        layers=args.layers,
        hidden=args.hidden,
        minutes=None if args.steps else args.minutes,
        steps=args.steps or 1_000_000,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        gen_tokens=args.gen_tokens,
        generator=args.generator,
        keep_checkpoint=args.keep_checkpoint,
    )
    report = distill.run(args.target, out, prompts, corpus, heldout, cfg)
    command = f"stoker train-draft {shlex.join(sys.argv[1:] if args.argv is None else args.argv)}"
    (out / "README.md").write_text(card.draft_card(report, args.target.name, command))
    text = report.agreement_text
    agreement = card.pct(text if text is not None else report.agreement_gen)
    print(
        f"draft written to {out}: {report.params:,} params, top-1 agreement {agreement}, "
        f"expected accepted tokens (k={distill.SPEC_K}) {report.accept_k4:.2f}"
    )
    return 0


def _run_eagle(args: argparse.Namespace, prompts: list[list[int]]) -> int:
    from stoker.tools.training import eagle

    cfg = eagle.EagleTrainConfig(
        minutes=None if args.steps else args.minutes,
        steps=args.steps or 1_000_000,
        batch_size=args.batch_size,
        lr=args.lr if args.lr != DEFAULT_LR else eagle.EagleTrainConfig.lr,
        seed=args.seed,
        gen_tokens=args.gen_tokens,
        num_layers=args.head_layers,
        device=args.device,
        save_dtype=args.head_dtype,
        draft_vocab=args.draft_vocab,
    )
    report = eagle.run(args.target, args.out, prompts, cfg)
    command = f"stoker train-draft {shlex.join(sys.argv[1:] if args.argv is None else args.argv)}"
    (args.out / "README.md").write_text(eagle.card(report, args.target.name, command))
    print(
        f"EAGLE head written to {args.out}: {report.params:,} params, accepted drafts per "
        f"verify (k={eagle.SPEC_K}) {report.engine_accept_k:.2f} served on held-out prompts"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # effective only before torch starts
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return run(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # e.g. a checkpoint of another shape
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
