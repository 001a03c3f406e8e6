"""Engine configuration: one dataclass, shared by the offline engine and the services."""

from __future__ import annotations

import dataclasses
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "stoker-tiny"


@dataclasses.dataclass
class EngineConfig:
    model: str = str(DEFAULT_MODEL)
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    block_size: int = 16
    num_kv_blocks: int | None = (
        None  # None: sized from kv_cache_memory_gb (CPU) or free memory (CUDA)
    )
    kv_cache_memory_gb: float = 1.0  # CPU only
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    # Skip the model: the worker returns a fixed next token at zero cost, so the whole pipeline
    # (api -> tokenizer -> scheduler -> worker -> detokenizer -> api) can be timed on its own.
    null_model: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
