"""The EAGLE proposer (services/worker/proposer.py): the head drafts k tokens per request from
the target's hidden states.

Like the draft model (services/worker/drafter.py) it keeps its own paged KV on the target's
block ids and catches up lazily, at the next proposal, on what it has not seen. Unlike it, it
needs the target's features for those positions: after every eager target forward the worker
hands it the tapped layer outputs (`record`), fused at once to one hidden-size vector per
position and kept per request until the head has consumed them. Positions whose features it
never got (computed inside a CUDA graph, or by the prefix cache before the request arrived) are
read as zeros: that costs acceptance there, never exactness, since only the target's verify
decides the output.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from stoker.common.model_config import ModelConfig, ModelLoadError
from stoker.services.worker.drafter import _DRAFT_SALT, _proposal_params, choose_drafts
from stoker.services.worker.eagle.config import EagleConfig
from stoker.services.worker.eagle.head import load_head
from stoker.services.worker.kv_sizing import kv_block_bytes
from stoker.services.worker.models.layers import CausalLM, linear, pack_weights
from stoker.services.worker.proposer import Proposal, ProposalItem, Proposer, Zeros
from stoker.services.worker.sampler import argmax_rows
from stoker.services.worker.sampling_noise import MASK63, SEED_MIX
from stoker.services.worker.step_inputs import Chunk, build_step_inputs, max_decode_chunk


class EagleProposer(Proposer):
    def __init__(
        self,
        folder: str | Path,
        target: CausalLM,
        target_cfg: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        seed: int = 0,
    ) -> None:
        self.cfg = EagleConfig.from_folder(folder)
        self.cfg.check_target(target_cfg, folder)
        self.target = target
        # Drafts reach k positions past the longest context.
        self.head = load_head(folder, self.cfg, dtype, device, max_model_len + 64)
        self.tap_layers = self.cfg.target_layers
        self.block_size, self.device, self.dtype = block_size, device, dtype
        self.decode_chunk = max_decode_chunk(device, dtype, self.cfg.layer_cfg)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.computed: dict[str, int] = {}  # per request: positions whose head K/V is valid
        self.feats: dict[str, tuple[int, torch.Tensor]] = {}  # (first position, [m, hidden])
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed((seed * SEED_MIX + _DRAFT_SALT) & MASK63)
        self.draft_lm_head = _draft_lm_head(target, self.head.d2t)

    def draft_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Float logits over the target's vocabulary for the head's output rows. A reduced
        draft vocabulary computes only its own rows and leaves the rest at -inf, so sampling
        (filters, logit bias, seeded noise by token id) runs unchanged over target ids, and q
        is zero where the head cannot propose: rejection sampling stays exact."""
        normed = self.head.final_norm(streams)
        if self.draft_lm_head is None:
            return self.target.compute_logits(normed).float()
        assert self.head.d2t is not None
        logits = self.target.soft_cap(linear(normed, self.draft_lm_head)).float()
        full = logits.new_full((len(logits), self.target.cfg.vocab_size), float("-inf"))
        full[:, self.head.d2t] = logits
        return full

    def greedy_drafts(self, streams: torch.Tensor) -> torch.Tensor:
        """Target token ids of the head's argmax rows. With a reduced vocabulary the argmax runs
        over the reduced logits alone (soft-capping is monotonic, so it is skipped): no
        full-vocabulary row, no sampling batch. Only ties can pick differently from the full
        path's, and verification keeps either choice exact."""
        normed = self.head.final_norm(streams)
        if self.draft_lm_head is None:
            return argmax_rows(self.target.compute_logits(normed))
        assert self.head.d2t is not None
        return self.head.d2t[argmax_rows(linear(normed, self.draft_lm_head))]

    # -- the rest of the Proposer surface ----------------------------------------------------------

    def kv_block_bytes(self, elem_size: int) -> int:
        c = self.cfg.layer_cfg
        return kv_block_bytes(c.num_layers, self.block_size, c.num_kv_heads, c.head_dim, elem_size)

    def allocate_kv(self, num_blocks: int, zeros: Zeros) -> None:
        c = self.cfg.layer_cfg
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [(zeros(shape), zeros(shape)) for _ in range(c.num_layers)]

    def drop(self, req_id: str) -> None:
        self.computed.pop(req_id, None)
        self.feats.pop(req_id, None)

    def accept(self, req_id: str, num_known_before: int, num_drafts: int, accepted: int) -> None:
        """Head rows past the last known token were fed its own features: recompute them from
        the target's. Target features past the accepted drafts belong to rejected tokens."""
        self.computed[req_id] = min(self.computed.get(req_id, 0), num_known_before)
        self._trim(req_id, num_known_before + accepted)

    # -- features from the target's forward ----------------------------------------------------

    def record(
        self,
        chunks: list[Chunk],
        req_ids: Iterable[str],
        taps: list[torch.Tensor],
        decode_chunk: int,
    ) -> None:
        """taps: per tapped layer, [T, hidden] outputs in the step's row order (chunks of up to
        decode_chunk tokens first: build_step_inputs' layout for the target's forward)."""
        fused = self.head.fuse_taps(torch.cat(taps, dim=-1))
        for (first, last), chunk, req_id in zip(chunk_rows(chunks, decode_chunk), chunks, req_ids):
            if req_id not in self.computed:  # new here: a prefix-cache hit computed the rest
                self.computed[req_id] = chunk.start
            new = fused[first:last]
            old = self.feats.get(req_id)
            if old is not None and old[0] <= chunk.start <= old[0] + len(old[1]):
                new = torch.cat([old[1][: chunk.start - old[0]], new])
                self.feats[req_id] = (old[0], new)
            else:  # a gap (a graph-captured step): what came before is no longer contiguous
                self.feats[req_id] = (chunk.start, new)

    def _trim(self, req_id: str, end: int) -> None:
        old = self.feats.get(req_id)
        if old is not None:
            self.feats[req_id] = (old[0], old[1][: max(0, end - old[0])])

    def _features(self, req_id: str, start: int, end: int) -> torch.Tensor:
        """Features of positions [start, end), zeros where there are none (and for -1)."""
        out = torch.zeros(end - start, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        old = self.feats.get(req_id)
        if old is not None:
            lo, hi = max(start, old[0]), min(end, old[0] + len(old[1]))
            if lo < hi:
                out[lo - start : hi - start] = old[1][lo - old[0] : hi - old[0]]
        return out

    # -- proposing -----------------------------------------------------------------------------

    def propose(self, items: list[ProposalItem]) -> list[Proposal]:
        """items: (req_id, known token ids, block ids, params, k, output tokens so far), as for
        Drafter.propose. A chain of k drafts: step 0 catches up and drafts from the target's
        features; each later step feeds the head's own output stream back as the feature."""
        drafts: list[list[int]] = [[] for _ in items]
        dists: list[list[torch.Tensor]] = [[] for _ in items]
        params = [_proposal_params(item[3]) for item in items]
        all_greedy = all(p.greedy for p in params)
        streams: torch.Tensor | None = None  # per active row: the head's last output
        row_of: dict[int, int] = {}  # item -> its row in `streams`
        for step in range(max(item[4] for item in items)):
            active = [i for i, item in enumerate(items) if len(drafts[i]) < item[4]]
            chunks, feats = [], []
            for i in active:
                req_id, tokens, blocks = items[i][:3]
                if step == 0:
                    start = min(self.computed.get(req_id, 0), len(tokens) - 1)
                    chunks.append(Chunk(tokens[start:], start, blocks, 1))
                    feats.append(self._features(req_id, start - 1, len(tokens) - 1))
                else:
                    chunks.append(Chunk([drafts[i][-1]], len(tokens) + step - 1, blocks, 1))
                    assert streams is not None
                    feats.append(streams[row_of[i]].unsqueeze(0))
            inputs = build_step_inputs(chunks, self.block_size, self.device, self.decode_chunk)
            features = _in_row_order(feats, chunks, self.decode_chunk)
            embeds = self.target.embed(inputs.input_ids)
            stream = self.head(embeds, features, inputs.positions, self.kv_caches, inputs.meta)
            streams = stream[inputs.sample_rows]
            row_of = {i: row for row, i in enumerate(active)}
            if all_greedy:
                chosen, probs = self.greedy_drafts(streams), None
            else:
                logits = self.draft_logits(streams)
                rows = [(params[i], items[i][3].seed, items[i][5] + step) for i in active]
                chosen, probs = choose_drafts(logits, rows, self.generator)
            for row, (i, token) in enumerate(zip(active, chosen.tolist())):
                drafts[i].append(token)
                if not params[i].greedy:
                    assert probs is not None
                    dists[i].append(probs[row])
        for req_id, tokens, *_ in items:
            # Rows at the known tokens were fed the target's features; later ones its own.
            self.computed[req_id] = len(tokens)
            self._drop_consumed(req_id, len(tokens) - 1)
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, dists)]

    def _drop_consumed(self, req_id: str, keep_from: int) -> None:
        old = self.feats.get(req_id)
        if old is not None and old[0] < keep_from:
            self.feats[req_id] = (keep_from, old[1][keep_from - old[0] :])


def _draft_lm_head(target: CausalLM, d2t: torch.Tensor | None) -> torch.Tensor | None:
    """The target's LM head rows for a reduced draft vocabulary (None: the whole head), laid
    out for oneDNN when the target's is."""
    if d2t is None:
        return None
    rows = target.lm_head_weight().detach()[d2t].contiguous()
    return pack_weights([rows])[0] if target.packed_lm_head is not None else rows


def chunk_rows(chunks: list[Chunk], decode_chunk: int) -> list[tuple[int, int]]:
    """Per chunk, its rows in the flat batch build_step_inputs makes: chunks of up to
    `decode_chunk` tokens first (the decode path), the rest after, each group in order."""
    short = [len(c.token_ids) <= decode_chunk for c in chunks]
    order = [i for i in range(len(chunks)) if short[i]] + [
        i for i in range(len(chunks)) if not short[i]
    ]
    rows: list[tuple[int, int]] = [(0, 0)] * len(chunks)
    first = 0
    for i in order:
        rows[i] = (first, first + len(chunks[i].token_ids))
        first = rows[i][1]
    return rows


def _in_row_order(
    feats: list[torch.Tensor], chunks: list[Chunk], decode_chunk: int
) -> torch.Tensor:
    rows = chunk_rows(chunks, decode_chunk)
    order = sorted(range(len(chunks)), key=lambda i: rows[i][0])
    return torch.cat([feats[i] for i in order])


def refuse_tensor_parallel(folder: str | Path) -> None:
    raise ModelLoadError(
        f"--speculative-model {folder} is an EAGLE head, which does not run under tensor "
        "parallelism: drop --tensor-parallel-size, or use --speculative ngram or a draft model"
    )
