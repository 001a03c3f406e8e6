"""Build small random-init Hugging Face model folders for tests and benchmarks (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

CORPUS = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Once upon a time there was a small inference server that kept the furnace fed.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🚀🔥, Ελληνικά, русский текст.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
]
SPECIAL = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


CONFIGS = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,  # saved as Gemma3ForCausalLM, model_type gemma3_text
    "phi3": Phi3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
}


def _randomise_zero_init(model: torch.nn.Module, std: float) -> None:
    """Gemma's (1 + w) norms and the MoE routers start at exactly zero (and Llama's norms at
    one); random values there make the tests see a wrong norm or routing convention. Only for
    the newer families, so the older families' test models stay as they were."""
    if model.config.model_type in ("llama", "mistral", "qwen2", "qwen3"):
        return
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * (std if "gate" in name else 0.3))


def make_model(
    path: str | Path,
    arch: str = "llama",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    initializer_range: float = 0.1,
    with_tokenizer: bool = True,
    **extra,
) -> Path:
    """Save a random-init model folder. A larger initializer_range than HF's default makes
    logits peaky, so float32 greedy ties (which make exactness tests flaky) are very unlikely."""
    path = Path(path)
    tokenizer = make_tokenizer(min(vocab_size, 512)) if with_tokenizer else None
    config = CONFIGS[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _randomise_zero_init(model, initializer_range)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
