"""`stoker bench offline`: runs benchmarks/offline_throughput.py with the given arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offline_throughput.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not SCRIPT.is_file():
        print(f"error: {SCRIPT} not found (run from a source checkout)", file=sys.stderr)
        return 1
    return subprocess.call([sys.executable, str(SCRIPT), *argv])


if __name__ == "__main__":
    sys.exit(main())
