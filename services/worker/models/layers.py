"""Pieces every model family shares: linear layers (oneDNN-packable), the paged attention block,
the gated MLP and the causal-LM shell (embedding, layer loop, final norm, logits).

Tokens of every request in a step are flattened into one [T, hidden] batch, so the linear
layers run as a few large matmuls; only attention looks at request boundaries. q/k/v and
gate/up projections are fused at load time to halve the number of matmul calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stoker.common.model_config import ModelConfig
from stoker.common.profiling import span
from stoker.kernels.dispatch import (  # triton on CUDA, the torch references elsewhere
    add_rms_norm,
    apply_rotary,
    causal_attention,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_attention_batched,
    qk_norm_rotary,
    rms_norm,
    silu_and_mul,
    store_kv,
)
from stoker.kernels import cpu_ops
from stoker.kernels.rotary import rope_cos_sin, rope_inv_freq
from stoker.services.worker.attention_metadata import AttentionMetadata
from stoker.services.worker.cpu_tuning import huge_page_arena

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin gathered by position, [T, rotary_dim]


def param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the CPU kernel for a weight `pack_weight` laid out: oneDNN's (float32 or
    bfloat16), the native panel kernel's (float32 or bfloat16, a 3-D [N / 16, K, 16] tensor) or
    the native bfloat16 pair kernel's (a 4-D [N / 16, K / 2, 16, 2] tensor); every other weight
    is 2-D."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dim() == 3:
        return cpu_ops.panel_linear(x, weight, bias)
    if weight.dim() == 4:
        return cpu_ops.bf16_pairs_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    return lambda x: F.gelu(x, approximate="tanh")  # gelu_pytorch_tanh (Gemma)


# The row count oneDNN lays packed weights out for. Any hint gives a blocked layout, where a
# plain `to_mkldnn()` keeps the row-major one; on the 2-core AVX2 box the blocked layout made 5-
# and 32-row GEMMs 10-30 % faster and 1 row about the same (docs/benchmarks.md, CPU kernels).
ONEDNN_BATCH_HINT = 64


def packs_to_panels(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` lays this weight out in the native panel kernel's layout (the same
    bytes, reordered) rather than oneDNN's opaque one: float32, and bfloat16 where the pair
    kernel (AVX512-BF16) is not built, since there torch's bfloat16 GEMM is 5-7x slower than
    the panels at 8 rows and more."""
    if weight.shape[0] % 16 or not cpu_ops.use_panel_linear():
        return False
    if weight.dtype == torch.bfloat16:
        return not cpu_ops.use_bf16_pairs()
    return weight.dtype == torch.float32


def packs_to_pairs(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` lays this bfloat16 weight out for the native pair kernel (the same
    bytes, reordered) rather than in oneDNN's opaque layout."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % 16 == k % 2 == 0 and cpu_ops.use_bf16_pairs()


def packs_natively(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` gives a native kernel's layout (plain bytes, so arena-placeable)."""
    return packs_to_panels(weight) or packs_to_pairs(weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """One [out, in] float32 or bfloat16 weight laid out for `linear`: in the native panel
    kernel's layout where `packs_to_panels`, the pair kernel's where `packs_to_pairs`, otherwise
    in oneDNN's blocked one. A bfloat16 weight stays a plain 2-D tensor (F.linear) on a CPU where
    oneDNN has no bfloat16 path (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, and refuses)."""
    if packs_to_panels(weight):
        return cpu_ops.pack_panels(weight)
    if packs_to_pairs(weight):
        return cpu_ops.pack_bf16_pairs(weight)
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return weight.detach().contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_BATCH_HINT)


def pack_weights(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """`pack_weight` of each, the natively laid-out ones (panels, pairs) in one huge-page arena
    (`cpu_tuning.huge_page_arena`), each at a 64-byte boundary for the kernels' loads.
    Weights are packed one at a time into the arena, so loading never holds two copies."""
    native = [packs_natively(w) for w in weights]
    slots = [-(-w.numel() * w.element_size() // 64) * 64 if n else 0 for w, n in zip(weights, native)]
    arena = huge_page_arena(sum(slots)) if sum(slots) else None
    out, start = [], 0
    for w, n, size in zip(weights, native, slots, strict=True):
        if not n:
            out.append(pack_weight(w))
            continue
        assert arena is not None  # sized above for every natively laid-out weight
        packed = pack_weight(w)
        slot = arena[start : start + packed.numel() * packed.element_size()]
        out.append(slot.view(packed.dtype).view(packed.shape).copy_(packed))
        start += size
    return out


def pack_module_linears(root: nn.Module) -> None:
    """Re-lay the 2-D linear weights (each module's LINEAR_WEIGHTS) under `root` out for
    `linear`'s CPU kernels. On CPU in float32 oneDNN's run 2-3x faster than F.linear's
    (measured on this project's 2-core box: 359 vs 118 GFLOPS at 64 rows), and the panel kernel
    faster still on AVX2 and AVX-512 boxes at decode's row counts. The result equals F.linear's
    to float32 rounding."""
    slots = [
        (module, name)
        for module in root.modules()
        for name in getattr(module, "LINEAR_WEIGHTS", ())
    ]
    packed = pack_weights([getattr(module, name) for module, name in slots])
    for (module, name), weight in zip(slots, packed, strict=True):
        del module._parameters[name]
        setattr(module, name, weight)


def pack_linear_weights(model: CausalLM) -> None:
    """A causal LM's linear weights and its LM head (tied or not), packed for `linear`."""
    pack_module_linears(model)
    model.packed_lm_head = pack_weights([model.lm_head_weight()])[0]


def input_norm(
    hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first norm: (normed, stream), folding in the previous layer's deferred add."""
    if residual is None:
        return rms_norm(hidden, weight, eps), hidden
    return add_rms_norm(hidden, residual, weight, eps)


def keep_rows(residual: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The residual stream of the rows the layer outputs (all, or meta.out_rows: the attention
    block returns those alone)."""
    return residual if meta.out_rows is None else residual[meta.out_rows]


class Attention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k norm, rotary (on the first rotary_dim
    dims), paged attention with this layer's sliding window and score soft-cap, output
    projection. `rope` indexes the model's rope tables (Gemma 3's local layers use their own)."""

    LINEAR_WEIGHTS = ("qkv_proj", "o_proj")

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.qkv_proj = param(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        self.q_norm = param(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = param(cfg.head_dim) if cfg.qk_norm else None
        self.o_proj = param(cfg.hidden_size, self.q_size)
        self.scale = cfg.attn_scale
        self.window = cfg.window(layer)
        self.softcap = cfg.attn_softcap
        self.rotary_dim = cfg.rotary_dim
        self.rope = 1 if cfg.local_rope_theta is not None and self.window else 0

    def forward(
        self, hidden: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = linear(hidden, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = hidden.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.rotary_dim == self.head_dim:
            q, k = qk_norm_rotary(q, k, self.q_norm, self.k_norm, self.eps, *rope)
        else:
            if self.q_norm is not None:
                q = rms_norm(q, self.q_norm, self.eps)
                k = rms_norm(k, self.k_norm, self.eps)
            q, k = self._rotary(q, k, *rope)
        with span("attention"):  # a no-op unless the profiler runs (common/profiling.py)
            attn = self._attention(q, k, v, kv_cache, meta)
        return linear(attn.view(attn.shape[0], self.q_size), self.o_proj)

    def _rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rotary(q, k, cos, sin)
        # Partial rotary (Phi-3): rotate the first r dims, pass the rest through.
        q_rot, k_rot = apply_rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention output of every row, or of meta.out_rows where set (K/V are stored
        for every row either way)."""
        key_cache, value_cache = kv_cache
        store_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        opts = dict(window=self.window, softcap=self.softcap)
        nd = meta.num_decode
        kept = meta.out_rows
        decoded = None
        if nd:
            assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
            decoded = paged_decode_attention(
                q[:nd],
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                **opts,
            )
            if not meta.prefills:
                return decoded  # a decode-only step: no copy into a combined output
        if meta.prefill_tables is not None:  # every prompt chunk in one call (native CPU kernel)
            assert meta.prefill_bounds is not None and meta.prefill_lens is not None
            prefilled = prefill_attention_batched(
                q[nd:] if kept is None else q[kept[nd:]],
                key_cache,
                value_cache,
                meta.prefill_tables,
                meta.prefill_bounds,
                meta.prefill_lens,
                self.scale,
                **opts,
            )
            if prefilled is not None:
                return prefilled if decoded is None else torch.cat([decoded, prefilled])
        out = torch.empty_like(q)
        if decoded is not None:
            out[:nd] = decoded
        for prefill in meta.prefills:
            rows = slice(prefill.start, prefill.end)
            if prefill.block_table is None:
                out[rows] = causal_attention(q[rows], k[rows], v[rows], self.scale, **opts)
            else:
                out[rows] = paged_prefill_attention(
                    q[rows],
                    key_cache,
                    value_cache,
                    prefill.block_table,
                    prefill.context_len,
                    self.scale,
                    **opts,
                )
        return out if kept is None else out[kept]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one [2 * inter, hidden] weight."""

    LINEAR_WEIGHTS = ("gate_up_proj", "down_proj")

    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = param(2 * intermediate_size, hidden_size)
        self.down_proj = param(hidden_size, intermediate_size)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)
        if self.act is F.silu:  # one pass, one launch on CUDA (kernels/triton_activation.py)
            return linear(silu_and_mul(gate_up), self.down_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(self.act(gate) * up, self.down_proj)


class CausalLM(nn.Module):
    """Embedding, decoder layers (built by `make_layer`), final norm and logits. A layer takes
    (hidden, residual, rope, kv_cache, meta) and returns (hidden, residual): the residual add is
    deferred into the next norm (add_rms_norm), so the stream is hidden + residual."""

    embed_scale: float | None = None  # Gemma multiplies the embeddings by sqrt(hidden)
    # Layers whose outputs (the residual stream) a forward appends to `taps`: set by the runner
    # around eager forwards when an EAGLE head is loaded (services/worker/eagle/), else empty.
    tap_layers: tuple[int, ...] = ()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else param(cfg.vocab_size, cfg.hidden_size)
        self.rope_tables: list[Rope] = []
        self.packed_lm_head: torch.Tensor | None = None
        self._embed_scale: torch.Tensor | None = None
        self.taps: list[torch.Tensor] = []

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        raise NotImplementedError

    def init_rope(self, max_positions: int, device: torch.device | str) -> None:
        """cos/sin tables, float32, built on the host (outside any meta-device context): the
        global one, and Gemma 3's local one. Also the embedding scale, in the weights' dtype."""
        cfg = self.cfg
        specs = [(cfg.rope_theta, cfg.rope_scaling)]
        if cfg.local_rope_theta is not None:
            specs.append((cfg.local_rope_theta, None))
        self.rope_tables = []
        for theta, scaling in specs:
            cos, sin = rope_cos_sin(rope_inv_freq(cfg.rotary_dim, theta, scaling), max_positions)
            self.rope_tables.append((cos.to(device), sin.to(device)))
        if self.embed_scale is not None:  # rounded to the dtype first, as transformers does
            scale = torch.tensor(self.embed_scale, dtype=self.embed_tokens.dtype)
            self._embed_scale = scale.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        last_layer_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden], or of the rows
        last_layer_meta.out_rows keeps (StepInputs.last_layer_meta)."""
        hidden = self.embed(input_ids)
        dtype = hidden.dtype
        ropes = [
            (cos[positions].to(dtype), sin[positions].to(dtype)) for cos, sin in self.rope_tables
        ]
        residual = None
        taps = self.tap_layers
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            layer_meta = last_layer_meta if i == last and last_layer_meta is not None else meta
            hidden, residual = layer(hidden, residual, ropes[layer.attn.rope], kv_cache, layer_meta)
            if taps and i in taps:  # an EAGLE head reads these layers' outputs
                self.taps.append(hidden + residual)
        hidden, _ = add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self._embed_scale is not None:
            hidden = hidden * self._embed_scale
        return hidden

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection as loaded, [vocab, hidden] (tied models: the embedding)."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma's tanh soft-capping of the logits; the identity for other models."""
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            logits = linear(hidden, self.packed_lm_head)
        else:
            logits = F.linear(hidden, self.lm_head_weight())
        return self.soft_cap(logits)
