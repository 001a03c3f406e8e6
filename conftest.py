"""Repository-level pytest set-up (docs/architecture.md, "Package layout").

Tests import stoker as installed (stoker.*) and their own helpers as tests.*. The repo root is
appended to sys.path, after site-packages, so that `import kernels` (transformers does) finds
Hugging Face's package, never this repo's kernels/ folder; child processes inherit
PYTHONSAFEPATH so that `python -m` run from here does not put the root first either.
"""

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", ".", ROOT)] + [ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
