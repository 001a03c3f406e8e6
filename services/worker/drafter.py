"""The draft model proposer (services/worker/proposer.py): a small model in the worker that
proposes k tokens per request.

Its KV cache has its own tensors but the target's block ids, so the scheduler's block accounting
covers both. It catches up lazily: each proposal first computes whatever tokens it has not seen
(the whole context the first time, then the tokens accepted since its last proposal), then
decodes k - 1 more steps. Requests that are not speculating cost it nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import torch

from stoker.common.model_config import ModelConfig, ModelLoadError
from stoker.common.sampling_params import SamplingParams
from stoker.services.worker.kv_sizing import kv_block_bytes
from stoker.services.worker.loader import check_model_folder, load_model
from stoker.services.worker.proposer import Proposal, ProposalItem, Proposer, Zeros
from stoker.services.worker.sampler import SamplingBatch, argmax_rows, filtered_probs
from stoker.services.worker.sampling_noise import MASK63, SEED_MIX, exponential_noise, seeded_noise
from stoker.services.worker.step_inputs import Chunk, build_step_inputs, max_decode_chunk

_DRAFT_SALT = 0x5EED_D4AF  # keeps draft noise apart from the target sampler's (seed, position)


class Drafter(Proposer):
    def __init__(
        self,
        folder: str,
        target: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        seed: int = 0,
    ) -> None:
        """Loads the weights; the KV cache comes later (`allocate_kv`), once the target's
        KV sizing has counted these weights and `kv_block_bytes` per block."""
        check_model_folder(folder)
        self.cfg = ModelConfig.from_folder(folder)
        if self.cfg.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"draft model {folder} has vocab {self.cfg.vocab_size}, the target "
                f"{target.vocab_size}: they must share a tokenizer"
            )
        self.model = load_model(folder, dtype, str(device), max_model_len)
        self.block_size, self.device = block_size, device
        self.decode_chunk = max_decode_chunk(device, dtype, self.cfg)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.computed: dict[str, int] = {}  # per request: positions whose draft K/V is valid
        # Its own stream, distinct from the target sampler's: proposals drawn with the same noise
        # as the token before them would be correlated with it.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed((seed * SEED_MIX + _DRAFT_SALT) & MASK63)

    def kv_block_bytes(self, elem_size: int) -> int:
        cfg = self.cfg
        return kv_block_bytes(
            cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim, elem_size
        )

    def allocate_kv(self, num_blocks: int, zeros: Zeros) -> None:
        shape = (num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_caches = [(zeros(shape), zeros(shape)) for _ in range(self.cfg.num_layers)]

    def drop(self, req_id: str) -> None:
        self.computed.pop(req_id, None)

    def record(
        self,
        chunks: list[Chunk],
        req_ids: Iterable[str],
        taps: list[torch.Tensor],
        decode_chunk: int,
    ) -> None:
        """Nothing to keep: it taps no target layer and reads token ids alone."""

    def propose(self, items: list[ProposalItem]) -> list[Proposal]:
        """items: (req_id, known token ids, block ids, params, k, output tokens so far). Returns
        per item the k draft ids and, for sampled requests, their proposal distributions q."""
        drafts: list[list[int]] = [[] for _ in items]
        dists: list[list[torch.Tensor]] = [[] for _ in items]
        params = [_proposal_params(item[3]) for item in items]
        for step in range(max(item[4] for item in items)):
            active = [i for i, item in enumerate(items) if len(drafts[i]) < item[4]]
            chunks = []
            for i in active:
                req_id, tokens, blocks = items[i][:3]
                if step == 0:  # catch up on everything not yet seen, ending at the last token
                    start = min(self.computed.get(req_id, 0), len(tokens) - 1)
                    chunks.append(Chunk(tokens[start:], start, blocks, 1))
                else:
                    chunks.append(Chunk([drafts[i][-1]], len(tokens) + step - 1, blocks, 1))
            inputs = build_step_inputs(chunks, self.block_size, self.device, self.decode_chunk)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            logits = self.model.compute_logits(hidden[inputs.sample_rows]).float()
            rows = [(params[i], items[i][3].seed, items[i][5] + step) for i in active]
            chosen, probs = choose_drafts(logits, rows, self.generator)
            for row, i in enumerate(active):
                drafts[i].append(int(chosen[row]))
                if not params[i].greedy:
                    dists[i].append(probs[row])
        for req_id, tokens, _, _, k, _ in items:
            # Computed: the context, then d_1 .. d_{k-1} (d_k was proposed, never fed back).
            self.computed[req_id] = len(tokens) + k - 1
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, dists)]

    def accept(self, req_id: str, num_known_before: int, num_drafts: int, accepted: int) -> None:
        """After verification only the accepted drafts' K/V stay valid."""
        # min: a verify of drafts proposed elsewhere (n-gram first) computed nothing here.
        valid = num_known_before + min(accepted, num_drafts - 1)
        self.computed[req_id] = min(self.computed.get(req_id, 0), valid)


def choose_drafts(
    logits: torch.Tensor,
    rows: list[tuple[SamplingParams, int | None, int]],
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of float logits; rows: (proposal params, the request's seed,
    its output position). Returns the tokens and, unless all greedy, the distributions q."""
    batch = SamplingBatch.build(
        [r[0] for r in rows], [[]] * len(rows), [[]] * len(rows), logits.shape[-1], logits.device
    )
    chosen = argmax_rows(logits)
    if batch.all_greedy:
        return chosen, None
    probs = filtered_probs(logits, batch)
    noise = exponential_noise(probs.shape, generator, probs.device)
    for row, (params, seed, position) in enumerate(rows):
        if seed is not None and not params.greedy:
            # Seeded: the noise the target draws this output position with, so the draft
            # proposes what the target picks whenever q is close to p (seeded verifies accept
            # a draft iff it equals that pick).
            noise[row] = seeded_noise(seed, position, noise.shape[-1], logits.device)
    sampled = argmax_rows(probs / noise.clamp_min_(1e-30))
    return torch.where(batch.greedy, chosen, sampled), probs


def _proposal_params(params: SamplingParams) -> SamplingParams:
    """The draft samples with the request's temperature and filters but no penalties or seed:
    rejection sampling corrects for any proposal distribution, as long as it is the q used."""
    return msgspec.structs.replace(
        params,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        seed=None,
        logprobs=None,
    )
