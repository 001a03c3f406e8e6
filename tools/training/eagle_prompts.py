"""A chat prompt file for training EAGLE heads on instruction-tuned targets (no data set is
bundled or downloadable here): topics crossed with question forms, shuffled with a fixed seed.
None of them is among benchmarks/speculative.py's held-out chat prompts.

    python -m tools.training.eagle_prompts /tmp/chat-prompts.txt
    stoker train-draft --method eagle --chat --prompts /tmp/chat-prompts.txt ...
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

TOPICS = [
    "photosynthesis",
    "the water cycle",
    "compound interest",
    "black holes",
    "vaccines",
    "the French Revolution",
    "machine learning",
    "recycling",
    "volcanoes",
    "the stock market",
    "sleep",
    "electric cars",
    "the immune system",
    "climate change",
    "the internet",
    "ancient Rome",
    "gardening",
    "public speaking",
    "time management",
    "the moon landing",
    "honeybees",
    "solar panels",
    "earthquakes",
    "budgeting",
    "learning a new language",
    "coffee",
    "the human heart",
    "rainbows",
    "democracy",
    "chess",
    "bread baking",
    "ocean tides",
    "password security",
    "meditation",
    "dinosaurs",
    "the printing press",
    "running a marathon",
    "the periodic table",
    "writing a resume",
    "friendship",
]
FORMS = [
    "Explain {} in simple terms.",
    "What are the main facts everyone should know about {}?",
    "Write a short paragraph about {}.",
    "Give me three tips related to {}.",
    "What is a common misconception about {}?",
    "How would you explain {} to a ten-year-old?",
    "Summarize the history of {} in a few sentences.",
    "List the pros and cons of {}.",
]


def chat_prompts(seed: int = 0) -> list[str]:
    prompts = [form.format(topic) for topic in TOPICS for form in FORMS]
    random.Random(seed).shuffle(prompts)
    return prompts


if __name__ == "__main__":
    Path(sys.argv[1]).write_text("\n".join(chat_prompts()) + "\n")
