"""Where `stoker eval` gets tokenizations and greedy outputs: a live deployment over HTTP, or
Hugging Face transformers on a model folder (float32, CPU). Both answer the same two calls."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol

import httpx

from stoker.tools.eval.compare import Output, Step, truncate_at_stop

GOLDEN = Path(__file__).with_name("golden.jsonl")
TOP_LOGPROBS = 5  # alternatives per step: what the near-tie check looks the other token up in


@dataclasses.dataclass
class Item:
    """One golden prompt: a plain `prompt` or chat `messages`, optional stop strings."""

    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    stop: list[str] | None = None
    max_tokens: int | None = None

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "prompt"


def load_items(path: str | Path = GOLDEN) -> list[Item]:
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        raw = json.loads(line)
        if ("prompt" in raw) == ("messages" in raw):
            raise ValueError(f"{path}:{n}: give exactly one of `prompt` and `messages`")
        items.append(Item(str(raw.get("id", f"line-{n}")), raw.get("prompt"), raw.get("messages"),
                          raw.get("stop"), raw.get("max_tokens")))  # fmt: skip
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


class Source(Protocol):
    name: str

    def tokenize(self, item: Item) -> list[int]: ...

    def generate(self, item: Item, max_tokens: int) -> tuple[Output, int | None]:
        """The greedy output, and the prompt length the source reports using (usage)."""
        ...


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(
            f"expected a `token_id:N` token (return_tokens_as_token_ids), got {token!r}"
        )
    return int(token.removeprefix("token_id:"))


class Deployment:
    """An OpenAI-compatible server with vLLM's /tokenize and return_tokens_as_token_ids
    (stoker, vLLM)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        self.name = url.rstrip("/")
        base = self.name.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base, headers=headers, timeout=timeout_s)
        self._model: str | None = None

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self._http.post(path, json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.name}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    @property
    def model(self) -> str:
        if self._model is None:
            resp = self._http.get("/v1/models")
            resp.raise_for_status()
            self._model = resp.json()["data"][0]["id"]
        return self._model

    def tokenize(self, item: Item) -> list[int]:
        body: dict[str, Any] = {"model": self.model}
        if item.messages is not None:
            body |= {"messages": item.messages, "add_generation_prompt": True}
        else:
            body["prompt"] = item.prompt
        return list(self._post("/tokenize", body)["tokens"])

    def generate(self, item: Item, max_tokens: int) -> tuple[Output, int | None]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": item.max_tokens or max_tokens,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        if item.stop:
            body["stop"] = item.stop
        if item.messages is not None:
            body |= {"messages": item.messages, "logprobs": True, "top_logprobs": TOP_LOGPROBS}
            out = self._post("/v1/chat/completions", body)
            choice = out["choices"][0]
            steps = [
                Step(_token_id(t["token"]), t["logprob"],
                     {_token_id(x["token"]): x["logprob"] for x in t["top_logprobs"]})
                for t in (choice["logprobs"] or {}).get("content") or []
            ]  # fmt: skip
            text = choice["message"]["content"] or ""
        else:
            body |= {"prompt": item.prompt, "logprobs": TOP_LOGPROBS}
            out = self._post("/v1/completions", body)
            choice = out["choices"][0]
            lp = choice["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
            steps = [
                Step(_token_id(t), x, {_token_id(k): v for k, v in (top or {}).items()})
                for t, x, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])
            ]
            text = choice["text"]
        usage = (out.get("usage") or {}).get("prompt_tokens")
        return Output(steps, choice["finish_reason"], text), usage


class Transformers:
    """The reference: transformers' own tokenizer and model on the folder, float32 on CPU,
    greedy, with a full-vocabulary log-softmax per step."""

    def __init__(self, folder: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name = str(folder)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        self.bos_id: int | None = self.tokenizer.bos_token_id

    def tokenize(self, item: Item) -> list[int]:
        """What a transformers user gets: `tokenizer(prompt)`, or the chat template with
        tokenize=True (no special tokens beyond the template's)."""
        if item.messages is not None:
            out = self.tokenizer.apply_chat_template(
                item.messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            return list(out["input_ids"])
        return list(self.tokenizer(item.prompt)["input_ids"])

    def generate(self, item: Item, max_tokens: int) -> tuple[Output, int | None]:
        torch = self.torch
        prompt = self.tokenize(item)
        steps: list[Step] = []
        finish = "length"
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(item.max_tokens or max_tokens):
                # The whole sequence each step, no KV cache: slower, but nothing between the
                # reference and the model's own forward that could itself be wrong.
                logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits
                logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
                top = torch.topk(logprobs, TOP_LOGPROBS)
                token = int(top.indices[0])
                alternatives = dict(zip(top.indices.tolist(), top.values.tolist()))
                steps.append(Step(token, float(top.values[0]), alternatives))
                if token in self.eos_ids:
                    finish = "stop"
                    break
                ids.append(token)
        ids_out = [s.token_id for s in steps if s.token_id not in self.eos_ids]
        text = self.tokenizer.decode(ids_out, skip_special_tokens=True)
        hit = truncate_at_stop(self.prefix_texts(ids_out), item.stop) if item.stop else None
        if hit is not None:  # what a server that honours `stop` should answer
            steps, finish, text = steps[: hit[0]], "stop", hit[1]
        return Output(steps, finish, text), len(prompt)

    def prefix_texts(self, ids: list[int]) -> list[str]:
        """Text of ids[: i + 1] for each i, for placing stop strings."""
        return [
            self.tokenizer.decode(ids[: i + 1], skip_special_tokens=True) for i in range(len(ids))
        ]
