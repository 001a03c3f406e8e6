"""stoker: an LLM inference server (README.md, docs/architecture.md).

The source folders sit at the top of the repository (services/, common/, kernels/, tools/,
models/) and install under this one import name, as stoker.services, stoker.common, ...
(setup.py), so that none of them is a top-level package of its own: Hugging Face's `kernels`,
which transformers imports, is never shadowed.
"""

from pathlib import Path

# Run from a checkout without an install (a lent GPU machine runs benchmarks/gpu_check.sh with
# the repo on PYTHONPATH), the folders beside this one are the subpackages, as setup.py maps them.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "setup.py").is_file() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))
