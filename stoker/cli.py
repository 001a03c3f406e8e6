"""The `stoker` command: serve the whole set, run one service, or use the offline engine."""

from __future__ import annotations

import argparse
import importlib
import sys

SERVICES = {
    "api": "stoker.services.api.__main__",
    "tokenizer": "stoker.services.tokenizer.__main__",
    "scheduler": "stoker.services.scheduler.__main__",
    "worker": "stoker.services.worker.__main__",
}
USAGE = """usage: stoker COMMAND [options]

commands:
  serve        start api, tokenizers, scheduler and worker (see `stoker serve --help`)
  generate     offline generation with the in-process engine
  fetch-model  fetch and convert a real model into the model cache (smollm2)
  train-draft  distil a small draft model from a target model
  bench serve  load-test any OpenAI-compatible server (see `stoker bench serve --help`)
  bench offline  offline throughput: stoker vs transformers (vs vLLM-CPU)
  eval         compare a live deployment with a reference run, token by token
  replay       re-send a --log-requests log's greedy requests by token id; report diffs
  api | tokenizer | scheduler | worker   run one service process on its own
"""


def _generate(argv: list[str]) -> int:
    from stoker.common.config import EngineConfig
    from stoker.common.config_args import add_flags, from_args

    parser = argparse.ArgumentParser(prog="stoker generate")
    parser.add_argument("prompts", nargs="*", default=["ROMEO:"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    add_flags(parser, EngineConfig)
    args = parser.parse_args(argv)
    import dataclasses

    from stoker.services.engine import LLM, SamplingParams

    config = from_args(EngineConfig, args)
    llm = LLM(**dataclasses.asdict(config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for out in llm.generate(args.prompts, params):
        print(f"--- {out.prompt!r} ({out.finish_reason})\n{out.prompt}{out.text}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from stoker.launcher import main as serve_main

        return serve_main(rest)
    if command == "generate":
        return _generate(rest)
    if command == "fetch-model":
        from stoker.services.fetch_model import main as fetch_main

        return fetch_main(rest)
    if command == "train-draft":
        from stoker.tools.training.train_draft import main as train_draft_main

        return train_draft_main(rest)
    if command == "replay":
        from stoker.tools.replay import main as replay_main

        return replay_main(rest)
    if command == "eval":
        from stoker.tools.eval.run import main as eval_main

        return eval_main(rest)
    if command == "bench" and rest and rest[0] in ("serve", "offline"):
        module = importlib.import_module(f"stoker.tools.bench.{rest[0]}")
        return module.main(rest[1:])
    if command in SERVICES:
        module = importlib.import_module(SERVICES[command])
        module.main(rest)
        return 0
    print(f"stoker: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
