"""The bundled default model: stoker's greedy output equals transformers' token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stoker.common.config import DEFAULT_MODEL
from stoker.services.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not (DEFAULT_MODEL / "config.json").exists(), reason="the bundled model is not built"
)
PROMPTS = [
    "ROMEO:\n",
    "First Citizen:\nBefore we proceed any further,",
    "KING HENRY:\nO God",
    "To be",
]


def test_bundled_greedy_matches_transformers():
    llm = LLM()  # no argument: the bundled model
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.inference_mode():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
        assert out.token_ids == ref[0, ids.shape[1] :].tolist()
    # Greedy text should look like lines of a play, not one token repeated.
    assert all(len(set(out.token_ids)) > 8 for out in outs)
