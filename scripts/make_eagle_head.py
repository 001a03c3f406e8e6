"""Build the EAGLE head for SmolLM2-135M-Instruct (models/smollm2-eagle, committed), the one
`--speculative draft` uses on that model.

One `stoker train-draft --method eagle` run with fixed seeds and a fixed step count. SmolLM2
first writes 1,440 distinct user turns itself (tools/training/self_chat.py; none of them is
one of benchmarks/speculative.py's held-out chat prompts; a tenth held out for the model card),
then answers them, 96 tokens each, and a one-layer bfloat16 head with an 8,192-token draft
vocabulary trains on its hidden states for 1,000 steps of 8 sequences. On the project's 2-core
CPU box this took 45 minutes in all: 13.0 generating answers and recording hidden
states, 27.5 training, the rest writing the turns and serving the held-out ones for the model
card. The folder is 14 MB (a 10.5 MB head and the tokenizer files). It also plots the training
curve.

    .venv/bin/python scripts/make_eagle_head.py [--steps 1000] [--out models/smollm2-eagle]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def card_says_this_script(out: Path, steps: int) -> None:
    """The model card names this script, not the temporary prompt file and local paths."""
    card = out / "README.md"
    lines = card.read_text().splitlines()
    made = [i for i, line in enumerate(lines) if line.startswith("    stoker train-draft ")]
    if made:
        lines[made[0]] = f"    .venv/bin/python scripts/make_eagle_head.py --steps {steps}"
        card.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default=str(REPO / "models" / "smollm2-eagle"))
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--num-prompts", type=int, default=1440)
    args = ap.parse_args()
    from stoker.common.model_registry import resolve_model
    from stoker.tools.training.train_draft import main as train_draft

    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "scripts"))
    from speculative import CHAT_PROMPTS  # the held-out chat prompts

    from stoker.tools.training.self_chat import self_chat_turns

    target = resolve_model(args.target)
    turns = self_chat_turns(target, args.num_prompts, seed=0, exclude=CHAT_PROMPTS)
    lines = [t.replace("\n", "\\n") for t in turns]  # --prompts reads one turn per line
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.txt"
        path.write_text("\n".join(lines) + "\n")
        argv = [
            "--method", "eagle", "--target", str(target), "--out", args.out,
            "--chat", "--prompts", str(path), "--num-prompts", str(len(lines)),
            "--gen-tokens", "96", "--steps", str(args.steps), "--batch-size", "8",
            "--draft-vocab", "8192", "--device", "cpu", "--head-dtype", "bfloat16", "--seed", "0",
        ]  # fmt: skip
        code = train_draft(argv)
    if code == 0:
        card_says_this_script(Path(args.out), args.steps)
    if code == 0:  # the training curve for docs/speculation.md
        from plot_eagle_curve import main as plot

        plot(args.out, str(REPO / "docs" / "images" / f"{Path(args.out).name}_curve.png"))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
