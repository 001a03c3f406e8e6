"""Build the EAGLE head for SmolLM2-135M-Instruct (models/smollm2-eagle, git-ignored), the one
`--speculative draft` uses on that model once it exists.

One `stoker train-draft --method eagle` run with fixed seeds and a fixed step count: the target
answers 320 chat prompts (made here from fixed templates, none of them in benchmarks/
speculative.py's held-out set), then a one-layer bfloat16 head trains on its hidden states. On
the project's 2-core CPU box this takes about 29 minutes (4.3 of data, 24.6 of training); the
folder is 13.9 MB (a 10.4 MB head and the tokenizer files). It also plots the training curve.

    .venv/bin/python scripts/make_eagle_head.py [--steps 500] [--out models/smollm2-eagle]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TASKS = [
    "Explain {t} to a ten-year-old.",
    "Give three facts about {t}.",
    "Write a short paragraph about {t}.",
    "What are common mistakes people make with {t}?",
    "Summarise the history of {t} in a few sentences.",
    "List some pros and cons of {t}.",
    "How would you teach a beginner about {t}?",
    "Write a two-line poem about {t}.",
    "What questions should I ask an expert on {t}?",
    "Describe {t} in one sentence, then in three.",
    "Give me a tip about {t} that most people do not know.",
    "Compare {t} with something from everyday life.",
    "What is the most important idea in {t}?",
    "Write a friendly note recommending {t} to a friend.",
    "Why might someone be interested in {t}?",
    "Make a short checklist for getting started with {t}.",
]
TOPICS = [
    "gardening", "photosynthesis", "saving money", "learning a language", "the moon",
    "bicycles", "volcanoes", "time management", "chess", "recycling", "the human heart",
    "baking bread", "electric cars", "sleep", "rainforests", "public speaking", "prime numbers",
    "the printing press", "honeybees", "running a marathon",
]  # fmt: skip


def prompts(seed: int = 0) -> list[str]:
    """320 distinct user turns, in a fixed shuffled order."""
    out = [task.format(t=topic) for task, topic in itertools.product(TASKS, TOPICS)]
    random.Random(seed).shuffle(out)
    return out


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
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--out", default=str(REPO / "models" / "smollm2-eagle"))
    ap.add_argument("--target", default="smollm2")
    args = ap.parse_args()
    from common.model_registry import resolve_model
    from services.training.train_draft import main as train_draft

    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "scripts"))
    from speculative import CHAT_PROMPTS  # the held-out chat prompts

    held_out = set(CHAT_PROMPTS)
    lines = prompts()
    assert not held_out & set(lines), "a training prompt is in the held-out benchmark set"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.txt"
        path.write_text("\n".join(lines) + "\n")
        argv = [
            "--method", "eagle", "--target", str(resolve_model(args.target)), "--out", args.out,
            "--chat", "--prompts", str(path), "--num-prompts", str(len(lines)),
            "--gen-tokens", "64", "--steps", str(args.steps), "--batch-size", "4",
            "--device", "cpu", "--head-dtype", "bfloat16", "--seed", "0",
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
