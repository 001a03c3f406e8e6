"""Plot an EAGLE head's training curve (held-out mean accepted drafts per verify, teacher
forced, against training minutes) from the table in its model card (README.md) to a PNG.

    .venv/bin/python scripts/plot_eagle_curve.py models/smollm2-eagle docs/images/curve.png
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def read_curve(card: str) -> list[tuple[float, float]]:
    table = card.split("Training curve", 1)[1]
    return [
        (float(m), float(a)) for m, a in re.findall(r"^\| ([\d.]+) \| ([\d.]+) \|$", table, re.M)
    ]


def main(head: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = read_curve((Path(head) / "README.md").read_text())
    if not points:
        raise SystemExit(f"no training curve in {head}/README.md")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([m for m, _ in points], [a for _, a in points], marker="o")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("accepted drafts per verify (k = 4)")
    ax.set_title(f"{Path(head).name}: held-out acceptance while training")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out} ({len(points)} points)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
