"""What a tree of drafts would accept against a chain, for an EAGLE head on held-out chat prompts.

A tree verifies several candidates per draft position in one forward; greedy verification then
accepts the longest path of the tree that the target's own tokens follow. Along that path the
head runs exactly as in a chain whose drafts were all right, so teacher forcing gives, at every
start position and draft depth, the rank of the target's token among the head's candidates.
Any static tree (a set of rank paths, as Medusa and EAGLE-1 write them) accepts, at a start,
the longest prefix of that rank sequence that is one of its nodes. This reports:
- the share of starts whose target token is in the head's top 1/2/3/4/8 at each depth;
- tokens per verify (accepted drafts + 1) for chains of 1 to 6 and for the best static tree of
  N nodes, chosen greedily by path frequency on half the prompts and scored on the other half
  (both halves, averaged), so the tree is not scored on the starts it was fitted to.

Whether a tree pays then depends on what a verify of N + 1 rows costs against a decode step
(benchmarks/verify_cost.py --rows ...).

    .venv/bin/python benchmarks/eagle_tree.py [--head models/smollm2-eagle] [--model smollm2]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_utils import write_result  # noqa: E402
from speculative import CHAT_PROMPTS  # noqa: E402

from stoker.common.model_registry import resolve_model  # noqa: E402

Path_ = tuple[int, ...]


def rank_paths(target: Path, head: Path, max_new: int, depth: int) -> list[list[list[int]]]:
    """Per prompt, per start in the generated part: the target token's rank at depths 1..depth
    (10**6 where it lies outside the head's draft vocabulary)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stoker.services.worker.eagle.config import EagleConfig
    from stoker.tools.training.eagle import collect
    from stoker.tools.training.eagle_net import EagleNet
    from stoker.tools.training.train_draft import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts, conts = chat_prompt_ids(tok, CHAT_PROMPTS), []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
            )
            conts.append(out[0, len(ids) :].tolist())
    cfg = EagleConfig.from_folder(head)
    data = collect(model, prompts, conts, tuple(cfg.target_layers), torch.device("cpu"))
    net = EagleNet(cfg)
    state = load_file(str(head / "model.safetensors"))
    net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    embed = model.get_input_embeddings().weight.detach()
    vocab = net.d2t if net.d2t is not None else torch.arange(embed.shape[0])
    to_draft = torch.full((embed.shape[0],), -1, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    lm_head = model.get_output_embeddings().weight.detach()[vocab]
    result = []
    with torch.no_grad():
        for r in range(len(prompts)):
            n = int(data.mask[r].sum())
            tokens, taps = data.tokens[r : r + 1, :n], data.taps[r : r + 1, :n].float()
            labels = to_draft[data.labels[r, :n]]
            outs = net.unroll(F.embedding(tokens, embed), taps, depth)
            ranks = []
            for out in outs:
                logits = out[0] @ lm_head.T
                mine = logits.gather(1, labels.clamp(min=0)[:, None])
                rank = (logits > mine).sum(1)
                rank[labels < 0] = 10**6
                ranks.append(rank.tolist())
            start = int(data.starts[r]) - 1  # the row predicting the first generated token
            result.append(
                [[ranks[j][s + j] for j in range(depth)] for s in range(start, n - depth)]
            )
    return result


def tokens_per_verify(paths: list[list[int]], tree: set[Path_]) -> float:
    total = 0
    for ranks in paths:
        d = 0
        while d < len(ranks) and tuple(ranks[: d + 1]) in tree:
            d += 1
        total += d
    return 1 + total / len(paths)


def fit_tree(paths: list[list[int]], nodes: int, max_rank: int = 10) -> set[Path_]:
    """The N most frequent rank paths, each added only after its parent (a connected tree)."""
    counts: Counter[Path_] = Counter()
    for ranks in paths:
        for d in range(1, len(ranks) + 1):
            if ranks[d - 1] >= max_rank:
                break
            counts[tuple(ranks[:d])] += 1
    tree: set[Path_] = set()
    while len(tree) < nodes:
        options = [
            (c, p) for p, c in counts.items() if p not in tree and (len(p) == 1 or p[:-1] in tree)
        ]
        if not options:
            break
        tree.add(max(options)[1])
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--head", default="models/smollm2-eagle")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 6, 8, 12, 16, 24, 32])
    args = ap.parse_args()
    torch.manual_seed(0)
    per_prompt = rank_paths(resolve_model(args.model), Path(args.head), args.max_tokens, args.depth)
    paths = [p for prompt in per_prompt for p in prompt]
    top = {
        k: [sum(p[j] < k for p in paths) / len(paths) for j in range(args.depth)]
        for k in (1, 2, 3, 4, 8)
    }
    chains = {k: tokens_per_verify(paths, {(0,) * d for d in range(1, k + 1)}) for k in range(1, 7)}
    halves = [
        [p for i, prompt in enumerate(per_prompt) if i % 2 == h for p in prompt] for h in (0, 1)
    ]
    trees = {
        n: sum(tokens_per_verify(halves[1 - h], fit_tree(halves[h], n)) for h in (0, 1)) / 2
        for n in args.nodes
    }
    for k, shares in top.items():
        print(f"top-{k} by depth:", " ".join(f"{s:.3f}" for s in shares))
    for k, v in chains.items():
        print(f"chain of {k}: {v:.3f} tokens per verify")
    for n, v in trees.items():
        print(f"tree of {n} nodes (fitted on the other half): {v:.3f} tokens per verify")
    result = {
        "model": args.model,
        "head": args.head,
        "starts": len(paths),
        "top_k_by_depth": top,
        "chain_tokens_per_verify": chains,
        "tree_tokens_per_verify": trees,
    }
    print("wrote", write_result("eagle_tree", result))


if __name__ == "__main__":
    main()
