"""Build the EAGLE head for SmolLM2-135M-Instruct (models/smollm2-eagle, committed), the one
`--speculative draft` uses on that model.

One `stoker train-draft --method eagle` run with fixed seeds and a fixed step count: the target
answers 1,440 chat prompts (36 task templates over 40 topics, none of them in benchmarks/
speculative.py's held-out set; a tenth held out for the model card), 96 tokens each, then a
one-layer bfloat16 head with an 8,192-token draft vocabulary trains on its hidden states for
1,000 steps of 8 sequences. On the project's 2-core CPU box this took 38 minutes (16.1 of data:
10.5 generating, 5.5 recording hidden states; 21.0 of training); the folder is 14 MB (a 10.5 MB
head and the tokenizer files). It also plots the training curve.

    .venv/bin/python scripts/make_eagle_head.py [--steps 1000] [--out models/smollm2-eagle]
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
    "What is {t}?",
    "How does {t} work?",
    "Tell me a short story that involves {t}.",
    "What would the world be like without {t}?",
    "Give me five words that come to mind with {t}, and say why.",
    "Is {t} a good topic for a school project? Explain.",
    "What are the first steps to learn about {t}?",
    "Write a limerick about {t}.",
    "Can you give an example that shows how {t} matters?",
    "What do people often misunderstand about {t}?",
    "Write a product description for a book about {t}.",
    "What is a fun fact about {t}?",
    "Create a short quiz with two questions about {t}.",
    "How has {t} changed over the last hundred years?",
    "Write a tweet about {t}.",
    "Explain {t} using a simple analogy.",
    "What safety advice would you give about {t}?",
    "Plan a weekend activity around {t}.",
    "Answer briefly: what is the hardest part of {t}?",
    "I am curious about {t}. Where should I start?",
]
TOPICS = [
    "gardening", "photosynthesis", "saving money", "learning a language", "the moon",
    "bicycles", "volcanoes", "time management", "chess", "recycling", "the human heart",
    "baking bread", "electric cars", "sleep", "rainforests", "public speaking", "prime numbers",
    "the printing press", "honeybees", "running a marathon", "the ocean tides", "jazz music",
    "solar panels", "dinosaurs", "friendship", "the internet", "coffee", "mountain climbing",
    "ancient Rome", "vaccines", "origami", "black holes", "composting", "the piano",
    "city parks", "earthquakes", "board games", "penguins", "writing a resume", "meditation",
]  # fmt: skip


def prompts(seed: int = 0) -> list[str]:
    """Every task on every topic (1,440 distinct user turns), in a fixed shuffled order."""
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
    ap.add_argument("--steps", type=int, default=1000)
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
