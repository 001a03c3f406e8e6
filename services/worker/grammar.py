"""Grammar masks next to the logits (docs/structured-outputs.md, "Where the work runs").

Each structured request keeps an llguidance matcher in the worker, built on one grammar thread
(from a cached template, by deep copy). A step's masks are filled on that thread while the
forward runs on a GPU, or on the step's thread just before the forward on a CPU, whose cores
the forward needs; either way they are applied to the logits just before sampling, and no mask
leaves this process. After sampling the step's thread consumes the new tokens (a few
microseconds each) and reads the tokens the grammar forces next, which the scheduler proposes
as drafts (fast-forward). The scheduler splits a step's fill time over its structured requests
(StepResult.grammar_mask_s), so no per-request timer is kept here.

A verify row (speculation) gets the mask of the state after the drafts before it: llguidance
computes them by consuming the drafts and rolling back, stopping at the first draft the grammar
rejects. That draft's row masks it out, so the target never accepts it, and the rows after it
are never read. Greedy output with speculation is therefore the same as without.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stoker.common.messages import pack_ids
from stoker.kernels.token_mask import apply_token_bitmask

log = logging.getLogger("stoker.worker")

TEMPLATES = 256  # grammars whose first matcher is kept for deep copies (LRU)
NUM_THREADS = 1


class RequestGrammar:
    """A request's matcher, built on the grammar thread with the outputs it resumes with."""

    __slots__ = ("matcher", "resumed")

    def __init__(self, resumed: list[int]) -> None:
        self.matcher: Any = None
        self.resumed = resumed  # a preempted request's outputs, consumed once it is built


class StepMasks:
    """A step's masks, being filled: `apply` waits for them and masks the logits rows."""

    def __init__(
        self, future: concurrent.futures.Future[tuple[torch.Tensor, float]], rows: list[int]
    ) -> None:
        self._future, self.rows = future, rows
        self._bitmask_: torch.Tensor | None = None
        self.fill_s = 0.0  # the time the step's masks took to fill
        self.wait_s = 0.0  # how long sampling waited: the part the forward did not hide

    def bitmask(self) -> torch.Tensor:
        """[logits rows, words] int32, once filled (every token allowed in rows without a
        grammar); waits for the grammar thread the first time."""
        if self._bitmask_ is None:
            t0 = time.perf_counter()
            self._bitmask_, self.fill_s = self._future.result()
            self.wait_s = time.perf_counter() - t0
        return self._bitmask_

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in the grammar rows only."""
        bitmask = self.bitmask()
        if not logits.is_cpu:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        apply_token_bitmask(logits, bitmask, torch.tensor(self.rows, dtype=torch.int64))

    def choose(self, tokens: list[int]) -> list[int]:
        """The null model's tokens under the masks: its own where allowed, else the lowest
        allowed id in the first word at or after its own that allows any (wrapping), so the
        host pipeline walks the grammar without a forward. Vectorised over the rows."""
        words = self.bitmask().numpy().view(np.uint32)
        rows = np.array([r for r in self.rows if r < len(tokens)], dtype=np.int64)
        if not len(rows):
            return list(tokens)
        mine = np.asarray(tokens, dtype=np.int64)[rows]
        w = np.minimum(mine >> 5, words.shape[1] - 1)
        allowed = (words[rows, w] >> (mine & 31).astype(np.uint32)) & 1
        bad = rows[allowed == 0]
        if not len(bad):
            return list(tokens)
        nonzero = words[bad] != 0
        start = (mine[allowed == 0] >> 5)[:, None]
        after = nonzero & (np.arange(words.shape[1])[None, :] >= start)
        first = np.where(after.any(axis=1), after.argmax(axis=1), nonzero.argmax(axis=1))
        word = words[bad, first].astype(np.int64)
        lowest = np.log2(word & -word).astype(np.int64)
        out = list(tokens)
        for row, token in zip(bad.tolist(), (32 * first + lowest).tolist()):
            out[row] = token
        return out


class Grammars:
    """The worker's matchers and the thread that runs them."""

    def __init__(
        self,
        model: str | Path,
        vocab_size: int,
        eos_token_id: int,
        fast_forward: bool = True,
        inline: bool = False,
    ) -> None:
        """inline: fill masks on the step's thread before the forward (a CPU device), not on
        the grammar thread during it."""
        import llguidance  # the grammar backend

        self._ll = llguidance
        self.vocab_size, self.eos = vocab_size, eos_token_id
        self.fast_forward, self.inline = fast_forward, inline
        self._words = (vocab_size + 31) // 32
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # Built on the grammar thread at start-up, off the step loop.
        self._tokenizer = self._thread.submit(self._build_tokenizer, model)
        self._executor = llguidance.LLExecutor(num_threads=NUM_THREADS)
        self._templates: OrderedDict[str, Any] = OrderedDict()  # grammar thread only
        self.requests: dict[str, RequestGrammar] = {}

    def _build_tokenizer(self, model: str | Path) -> Any:
        import llguidance.hf

        from stoker.common.tokenizer_files import load_tokenizer

        hf = load_tokenizer(model)
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos)

    # -- requests ---------------------------------------------------------------------------

    def add(self, req_id: str, grammar: str, output_ids: Sequence[int]) -> None:
        """A new (or resumed) structured request: its matcher is built on the grammar thread,
        then consumes the outputs it already has."""
        state = RequestGrammar(list(output_ids))
        self.requests[req_id] = state
        self._thread.submit(self._build_matcher, state, grammar)

    def _build_matcher(self, state: RequestGrammar, grammar: str) -> None:
        try:
            matcher = self._matcher(grammar)
            if state.resumed and not matcher.consume_tokens(state.resumed):
                log.warning("a grammar rejected a resumed output: %s", matcher.get_error())
            state.matcher = matcher
        except Exception:  # the tokenizer process compiled it: this is a bug, not the client's
            log.exception("building a grammar matcher failed")

    def _matcher(self, grammar: str) -> Any:
        template = self._templates.get(grammar)
        if template is None:
            template = self._ll.LLMatcher(self._tokenizer.result(), grammar)
            self._templates[grammar] = template
            if len(self._templates) > TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        return template.deep_copy()

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def advance(self, rows: list[tuple[str, Sequence[int]]]) -> tuple[list[str], list[bytes]]:
        """Consume the tokens a step produced, per structured request (its masks are filled, so
        the grammar thread is done with these matchers); return the requests whose grammar now
        forces tokens, and those tokens packed, for the scheduler to propose as drafts
        (fast-forward). One token each (a decode step) is consumed in one parallel call."""
        states = [(self.requests.get(r), tokens) for r, tokens in rows]
        live = [(s, tokens) for s, tokens in states if s is not None and s.matcher is not None]
        singles = [(s.matcher, tokens[0]) for s, tokens in live if len(tokens) == 1]
        ok = self._executor.consume_token_par(singles) if singles else []
        if not all(ok):
            log.warning("a grammar rejected a sampled token")
        for s, tokens in live:
            if len(tokens) > 1 and not s.matcher.consume_tokens(list(tokens)):
                log.warning("a grammar rejected a sampled token: %s", s.matcher.get_error())
        forced_ids: list[str] = []
        forced: list[bytes] = []
        if self.fast_forward:
            for (req_id, _), (s, _) in zip(rows, states):
                if s is None or s.matcher is None or s.matcher.is_stopped():
                    continue
                ids = s.matcher.compute_ff_tokens()
                if ids:
                    forced_ids.append(req_id)
                    forced.append(pack_ids(ids))
        return forced_ids, forced

    # -- a step -----------------------------------------------------------------------------

    def begin(self, rows: list[tuple[str, int, list[int]]], num_rows: int) -> StepMasks | None:
        """Start filling the masks of a step with num_rows logits rows. rows: (request, its
        first logits row, the drafts it verifies); a verify's rows follow its first."""
        if not rows:
            return None
        jobs = [(self.requests[r], first, drafts) for r, first, drafts in rows]
        if self.inline:
            # The CPU is the device: a fill beside the forward only takes cores from it (and
            # waits out its threads' spinning), so fill first, once the builds queued are done.
            if any(state.matcher is None for state, _, _ in jobs):
                self._thread.submit(lambda: None).result()
            future: concurrent.futures.Future[tuple[torch.Tensor, float]] = (
                concurrent.futures.Future()
            )
            future.set_result(self._fill(jobs, num_rows))
        else:
            future = self._thread.submit(self._fill, jobs, num_rows)
        mask_rows = [first + j for _, first, drafts in rows for j in range(len(drafts) + 1)]
        return StepMasks(future, mask_rows)

    def _fill(
        self, jobs: list[tuple[RequestGrammar, int, list[int]]], num_rows: int
    ) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        # -1: every token allowed, for rows no grammar fills (past a rejected draft).
        bitmask = torch.full((num_rows, self._words), -1, dtype=torch.int32)
        for state, _, _ in jobs:
            if state.matcher is None:  # its build failed (logged): it may only end
                state.matcher = self._ll.LLMatcher(self._tokenizer.result(), '{"grammars": []}')
        # llguidance's executor writes rows of the buffer in place (what llguidance.torch's
        # helpers do; that module is not imported: it pulls in torch.compile and triton).
        plain = [(s.matcher, first) for s, first, drafts in jobs if not drafts]
        verify = [(s.matcher, first, drafts) for s, first, drafts in jobs if drafts]
        row_bytes = self._words * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, num_rows)
        if verify:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                verify, bitmask.data_ptr(), row_bytes, num_rows
            )
        # A matcher in error (or past its end) allows nothing: allow EOS, so the row still
        # samples and the request ends.
        dead = ~bitmask.any(dim=1)
        if bool(dead.any()):
            bit = self.eos % 32
            bitmask[dead, self.eos // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32
        return bitmask, time.perf_counter() - t0
