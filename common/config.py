"""Engine configuration: one dataclass, shared by the offline engine and the services. Each field
is also its command-line flag (common/config_args.py), in the order `--help` lists them; names
follow vLLM's (`--max-num-seqs`, `--max-model-len`, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from stoker.common.config_args import Flag, flag
from stoker.common.kv_events_config import KVEventsConfig
from stoker.common.model_registry import (
    BUNDLED_DIR,
    DEFAULT_DRAFT,
    DEFAULT_NAME,
    default_draft,
    resolve_model,
)

DEFAULT_MODEL = BUNDLED_DIR / "stoker-tiny"
DEFAULT_DRAFT_MODEL = BUNDLED_DIR / DEFAULT_DRAFT  # --speculative draft on any other model
CPU_PREFILL_CHUNK_TOKENS = 512
NGRAM_SPECULATIVE_TOKENS = 8
CPU_SPEC_ROW_COST = 0.3
ENGINE = "engine"  # the --help section of the engine's flags

# Flags more than one process takes, each declared here once.
MAX_MODEL_LEN = Flag(None)
PROFILE_DIR = Flag(
    None,
    "enable POST /start_profile and /stop_profile; traces land in DIR "
    "(docs/observability.md#profiling)",
    metavar="DIR",
)
STEP_TIMEOUT_S = Flag(
    60.0,
    "an engine step (or the scheduler's stats) silent this long means the engine failed: "
    "the api fails what is in flight, the scheduler exits 3",
)


def fit_to_pool(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """The context length a KV pool can serve: a lone request must always fit in the pool, or
    preempting everyone else could never make room for it. The worker's pool sizing and the
    scheduler core both apply it (docs/kv-cache.md)."""
    return min(max_model_len, num_blocks * block_size)


def _kv_events_config(text: str) -> str:
    """Checked while parsing, so that `stoker serve` refuses a bad config before starting
    anything."""
    try:
        KVEventsConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


@dataclasses.dataclass
class EngineConfig:
    model: str = flag(
        str(DEFAULT_MODEL),
        "a Hugging Face folder, a .gguf file, or a name: smollm2, stoker-tiny, default "
        "(smollm2 once `stoker fetch-model smollm2` has run, else stoker-tiny); env STOKER_MODEL",
        env="STOKER_MODEL",
        cli_default=DEFAULT_NAME,
        group=ENGINE,
    )
    device: str = flag("cpu", "cpu or cuda[:N]", group=ENGINE)
    dtype: str = flag("auto", choices=["auto", "float32", "bfloat16", "float16"], group=ENGINE)
    block_size: int = flag(16, group=ENGINE)
    # None: sized from kv_cache_memory_gb (CPU) or free memory (CUDA)
    num_kv_blocks: int | None = flag(None, "override KV cache sizing", group=ENGINE)
    kv_cache_memory_gb: float = flag(1.0, group=ENGINE)  # CPU only
    gpu_memory_utilization: float = flag(0.9, group=ENGINE)
    max_num_seqs: int = flag(256, group=ENGINE)
    max_num_batched_tokens: int = flag(2048, group=ENGINE)
    # Prompt tokens per step, decodes not counted (SGLang's chunked prefill size); 0: only
    # max_num_batched_tokens caps them. None: 512 on CPU, where a prefill step is
    # arithmetic-bound from ~64 rows, so bigger chunks buy no throughput and only make each
    # prompt of a wave wait for the whole wave (SmolLM2 at 32 streams: TTFT p50 4.6 s with
    # 2048-token steps, 2.3 s with 512; docs/benchmarks.md, thirteenth session); 0 on CUDA
    # and for the null model.
    prefill_chunk_tokens: int | None = flag(
        None,
        "prompt tokens per step, decodes not counted (default: 512 on CPU; 0: no cap)",
        group=ENGINE,
    )
    # None: the model's max_position_embeddings
    max_model_len: int | None = MAX_MODEL_LEN.field(group=ENGINE)
    enable_prefix_caching: bool = flag(True, group=ENGINE)
    seed: int = flag(0, group=ENGINE)
    # CUDA graphs for decode-only steps (vLLM's name and default). Graphs are only ever captured
    # on CUDA; on CPU every step runs eagerly whatever this says.
    enforce_eager: bool = flag(
        False,
        "never capture CUDA graphs (decode steps are captured on CUDA by default)",
        group=ENGINE,
    )
    # Largest decode batch captured (capped by max_num_seqs); larger decode batches run eagerly.
    max_cudagraph_capture_size: int = flag(
        256,
        "largest decode batch captured as a CUDA graph (capped by --max-num-seqs)",
        group=ENGINE,
    )
    grammar_fast_forward: bool = flag(
        True,
        "structured outputs: propose the tokens a grammar forces as drafts, verified like any "
        "draft, so greedy output is unchanged (docs/structured-outputs.md)",
        group=ENGINE,
    )
    # Speculative decoding (docs/speculation.md): None, "ngram" (prompt lookup, proposed by the
    # scheduler) or "draft" (a small model in the worker; default: the bundled draft).
    speculative: str | None = flag(None, choices=["ngram", "draft"], group=ENGINE)
    speculative_model: str | None = flag(
        None,
        "a draft model folder, or an EAGLE head's (train-draft --method eagle); implies draft",
        group=ENGINE,
    )
    # Drafts per verify, the most adaptive k offers. None: 8 for n-gram, whose drafts are free
    # and, once a span is being copied, mostly right (SmolLM2 copy-heavy text at batch 1: 3.53x
    # against 2.47x with 4; docs/benchmarks.md, fourteenth session), else 4, since every draft
    # of a draft model or head costs a forward of its own.
    num_speculative_tokens: int | None = flag(
        None,
        "drafts per verify, adaptive k's ceiling (default: 8 for ngram, else 4)",
        group=ENGINE,
    )
    speculative_adaptive: bool = flag(
        True, "per-request k from recent acceptance, and off for large batches", group=ENGINE
    )
    # Adaptive speculation turns off for a step with more decoding requests than this: past it,
    # a verify step costs more than the tokens it saves (measured: docs/benchmarks.md).
    speculative_max_batch: int = flag(8, group=ENGINE)
    # With a draft model or head: verify a prompt-lookup match's ids when there is one, and ask
    # the model for drafts only when there is none. Free to propose, and on SmolLM2's held-out
    # chat at batch 1 it took the bundled head from 1.18x / 1.38x to 1.56x / 1.43x (n-gram
    # alone 1.32x / 1.30x; docs/benchmarks.md, fourteenth session).
    speculative_ngram_first: bool = flag(
        True,
        "with a draft model or head: use an n-gram match's drafts when there is one",
        group=ENGINE,
    )
    # Adaptive speculation gives a request no drafts in a step with B decoding requests while it
    # averages fewer than row_cost x (B - 1) accepted drafts per verify (services/scheduler/
    # speculation.py). None: 0.3 on CPU, where a batched forward's cost grows with its rows
    # (SmolLM2 float32, 2 cores: an EAGLE head at 0.54 accepted drafts per verify paid 1.22x
    # at batch 1 and 0.78x at 4; n-gram on chat at about 2, 0.82-0.90x at 8), and 0 on CUDA,
    # where it was not measured.
    speculative_row_cost: float | None = flag(
        None,
        "adaptive: a request drafts only while it averages row_cost x (batch - 1) accepted"
        " drafts per verify (default: 0.3 on CPU, 0 on CUDA)",
        group=ENGINE,
    )
    # Tensor parallelism (docs/parallelism.md): ranks in all, over nnodes nodes, rendezvous as
    # torchrun's (node 0's master_addr:master_port; None: a free port when single-node, else
    # torchrun's 29500). NCCL on CUDA, gloo on CPU.
    tensor_parallel_size: int = flag(
        1,
        "shard the model over N ranks (NCCL on CUDA, gloo on CPU; docs/parallelism.md)",
        aliases=("-tp",),
        group=ENGINE,
    )
    nnodes: int = flag(1, "nodes the ranks span", group=ENGINE)
    node_rank: int = flag(0, "this node's index", group=ENGINE)
    master_addr: str = flag("127.0.0.1", "node 0's address", group=ENGINE)
    master_port: int | None = flag(
        None,
        "node 0's rendezvous port (default: a free one on one node, 29500 on several)",
        group=ENGINE,
    )
    # KV-cache events for cache-aware routers (docs/kv-events.md): vLLM's KVEventsConfig as a
    # JSON object, read by the scheduler; None publishes nothing.
    kv_events_config: str | None = flag(
        None,
        'publish KV-cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
        '"endpoint": "tcp://*:5557", "topic": "kv"}\' (docs/kv-events.md)',
        metavar="JSON",
        parse=_kv_events_config,
        group=ENGINE,
    )
    # The worker's and the scheduler's torch profiler write here (the offline LLM does not
    # profile); None: profiling is off.
    profile_dir: str | None = PROFILE_DIR.field(group=ENGINE)
    # Skip the model: the worker returns a fixed next token at zero cost, so the whole pipeline
    # (api -> tokenizer -> scheduler -> worker -> detokenizer -> api) can be timed on its own.
    null_model: bool = flag(
        False,
        "no model compute: measure the host pipeline alone (tokenizer from --model)",
        switch=True,
        group=ENGINE,
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.prefill_chunk_tokens is None:
            cpu = self.device == "cpu" and not self.null_model
            self.prefill_chunk_tokens = CPU_PREFILL_CHUNK_TOKENS if cpu else 0
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0 (0: no cap)")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_cudagraph_capture_size < 1:
            raise ValueError("max_cudagraph_capture_size must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be ngram or draft, got {self.speculative!r}")
        # A short name (smollm2, stoker-tiny, default) becomes the folder or file it names.
        self.model = str(resolve_model(self.model))
        if self.speculative_model:
            self.speculative_model = str(resolve_model(self.speculative_model))
        if self.profile_dir:  # one place whatever directory a process starts in
            self.profile_dir = os.path.abspath(self.profile_dir)
        if self.speculative_model and self.speculative is None:
            self.speculative = "draft"
        if self.speculative == "draft" and not self.speculative_model:
            self.speculative_model = str(default_draft(self.model))
        if self.num_speculative_tokens is None:
            ngram = self.speculative == "ngram"
            self.num_speculative_tokens = NGRAM_SPECULATIVE_TOKENS if ngram else 4
        if self.speculative_row_cost is None:
            self.speculative_row_cost = CPU_SPEC_ROW_COST if self.device == "cpu" else 0.0
        if self.speculative_row_cost < 0:
            raise ValueError("speculative_row_cost must be >= 0")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp < 1 or nodes < 1 or tp % nodes:
            raise ValueError(
                f"tensor_parallel_size {tp} must be a positive multiple of nnodes {nodes}"
            )
        if not 0 <= self.node_rank < nodes:
            raise ValueError(f"node_rank must be in [0, {nodes}), got {self.node_rank}")
        if tp > 1 and self.null_model:
            raise ValueError("the null model has nothing to shard: use tensor_parallel_size 1")
