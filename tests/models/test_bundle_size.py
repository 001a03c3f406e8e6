"""The bundled model files stay within their caps: 40 MB in all, 15 MB for the EAGLE head."""

from __future__ import annotations

from stoker.common.model_registry import BUNDLED, BUNDLED_DIR

MB = 1_000_000


def _size(name: str) -> int:
    folder = BUNDLED_DIR / name
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def test_bundled_models_fit_their_caps() -> None:
    sizes = {name: _size(name) for name in BUNDLED}
    assert sum(sizes.values()) <= 40 * MB, sizes
    assert sizes["smollm2-eagle"] <= 15 * MB, sizes
