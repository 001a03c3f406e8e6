"""The grammar-backend benchmark's inputs (benchmarks/schema_corpus.py): a corpus of at least
200 real schemas read from installed packages in a fixed order, probes whose instances the
oracle (jsonschema) judges as labelled, and a smoke of the llguidance path on 3 schemas."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("check_jsonschema")
pytest.importorskip("kubernetes_validate")

from schema_corpus import KEYWORD_PROBES, load_corpus, load_corpus_with_skips, validate  # noqa: E402

from stoker.common.model_registry import cached_model_path  # noqa: E402


@pytest.fixture(scope="module")
def loaded() -> tuple[list[tuple[str, dict]], list[tuple[str, str]]]:
    return load_corpus_with_skips()


def test_the_corpus_has_200_local_schemas_in_a_fixed_order(loaded) -> None:
    corpus, skipped = loaded
    names = [n for n, _ in corpus]
    assert len(names) >= 200 and len(set(names)) == len(names)
    assert names == [n for n, _ in load_corpus()]
    assert {n.split("/")[0] for n in names} >= {"schemastore", "kubernetes", "pydantic"}
    # a ref outside the schema is skipped and counted, never fetched
    assert all(r.startswith("#") for _, s in corpus for r in _refs(s))
    assert any("non-local $ref" in reason for _, reason in skipped)


@pytest.mark.parametrize("keyword, schema, bad, good", KEYWORD_PROBES, ids=lambda x: str(x)[:40])
def test_each_probe_forbids_its_bad_instance_and_allows_its_good_one(
    keyword: str, schema: dict, bad: str, good: str
) -> None:
    assert not validate(schema, bad).valid
    assert validate(schema, good).valid


def test_llguidance_compiles_and_walks_three_schemas_to_valid_outputs(loaded) -> None:
    pytest.importorskip("llguidance")
    path = cached_model_path("smollm2")
    if not (path / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 not fetched (`stoker fetch-model smollm2`)")
    from grammar_backends import Llguidance, finishing_tokens, walk
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(path)
    b = Llguidance(hf_tok, threads=1)
    finishing = finishing_tokens(hf_tok)
    schemas = dict(loaded[0])
    for name in ["pydantic/example.Invoice", "pydantic/example.Event", "kubernetes/binding-v1"]:
        b.compile(schemas[name])
        ids, finished, error, mask_us, _ = walk(
            b, random.Random(0), hf_tok.eos_token_id, finishing, 300, fresh=False
        )
        assert finished and error is None and len(mask_us) == len(ids), name
        text = hf_tok.decode(ids, clean_up_tokenization_spaces=False)
        assert validate(schemas[name], text).valid, (name, text)
    with pytest.raises(ValueError, match="uniqueItems"):  # strict: unsupported is an error
        b.compile({"type": "array", "uniqueItems": True})


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for k, v in node.items() if k != "$ref" for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []
