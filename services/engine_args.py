"""Command-line flags for EngineConfig, shared by `stoker serve`, the scheduler and the worker.
Names follow vLLM's (`--max-num-seqs`, `--max-model-len`, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from common.config import EngineConfig
from common.model_registry import DEFAULT_NAME


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=os.environ.get("STOKER_MODEL", DEFAULT_NAME),
        help="a Hugging Face folder, a .gguf file, or a name: smollm2, stoker-tiny, default "
        "(smollm2 once `stoker fetch-model smollm2` has run, else stoker-tiny); env STOKER_MODEL",
    )
    g.add_argument("--device", default=d.device, help="cpu or cuda[:N]")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="override KV cache sizing")
    g.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        help="prompt tokens per step, decodes not counted (default: 512 on CPU; 0: no cap)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=d.enforce_eager,
        help="never capture CUDA graphs (decode steps are captured on CUDA by default)",
    )
    g.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        default=d.max_cudagraph_capture_size,
        help="largest decode batch captured as a CUDA graph (capped by --max-num-seqs)",
    )
    g.add_argument("--speculative", choices=["ngram", "draft"], default=None)
    g.add_argument(
        "--speculative-model",
        default=None,
        help="a draft model folder, or an EAGLE head's (train-draft --method eagle); implies draft",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="drafts per verify, adaptive k's ceiling (default: 8 for ngram, else 4)",
    )
    g.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=d.speculative_adaptive,
        help="per-request k from recent acceptance, and off for large batches",
    )
    g.add_argument("--speculative-max-batch", type=int, default=d.speculative_max_batch)
    g.add_argument(
        "--speculative-ngram-first",
        action=argparse.BooleanOptionalAction,
        default=d.speculative_ngram_first,
        help="with a draft model or head: use an n-gram match's drafts when there is one",
    )
    g.add_argument(
        "--speculative-row-cost",
        type=float,
        default=None,
        help="adaptive: a request drafts only while it averages row_cost x (batch - 1) accepted"
        " drafts per verify (default: 0.3 on CPU, 0 on CUDA)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="shard the model over N ranks (NCCL on CUDA, gloo on CPU; docs/parallelism.md)",
    )
    # Multi-node rendezvous, named as torchrun's (docs/parallelism.md).
    g.add_argument("--nnodes", type=int, default=d.nnodes, help="nodes the ranks span")
    g.add_argument("--node-rank", type=int, default=d.node_rank, help="this node's index")
    g.add_argument("--master-addr", default=d.master_addr, help="node 0's address")
    g.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="node 0's rendezvous port (default: a free one on one node, 29500 on several)",
    )
    g.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help='publish KV-cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
        '"endpoint": "tcp://*:5557", "topic": "kv"}\' (docs/kv-events.md)',
    )
    g.add_argument(
        "--profile-dir",
        default=None,
        metavar="DIR",
        help="enable POST /start_profile and /stop_profile; traces land in DIR "
        "(docs/observability.md#profiling)",
    )
    g.add_argument(
        "--null-model",
        action="store_true",
        help="no model compute: measure the host pipeline alone (tokenizer from --model)",
    )


def _kv_events_config(text: str) -> str:
    """Checked here so that `stoker serve` refuses a bad config before starting anything."""
    from services.scheduler.kv_events import KVEventsConfig

    try:
        KVEventsConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def engine_args_to_argv(args: argparse.Namespace) -> list[str]:
    """Re-serialise engine flags for child processes."""
    argv: list[str] = []
    for field in dataclasses.fields(EngineConfig):
        value = getattr(args, field.name, None)
        if value is None:
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.name == "null_model":
            if value:
                argv.append(flag)
        elif isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    if getattr(args, "profile_dir", None):  # not an EngineConfig field: the worker and
        argv += ["--profile-dir", os.path.abspath(args.profile_dir)]  # scheduler take it apart
    return argv
