"""The tree arithmetic of benchmarks/eagle_tree.py: what a static tree accepts given, per start,
the rank of the target's token at each draft depth, and the greedy tree fit."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from eagle_tree import fit_tree, tokens_per_verify  # noqa: E402

PATHS = [[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0]]


def test_a_chain_accepts_the_leading_top1_run() -> None:
    chain2 = {(0,), (0, 0)}
    # accepted drafts: 2, 1, 0, 2 (the chain stops at depth 2) -> 1 + 5/4 tokens per verify
    assert tokens_per_verify(PATHS, chain2) == 2.25
    assert tokens_per_verify(PATHS, set()) == 1.0


def test_a_tree_accepts_the_longest_prefix_among_its_nodes() -> None:
    tree = {(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)}
    # accepted: (0, 0) -> 2, (0, 1) -> 2, (1, 0) -> 2, (0, 0, 0) -> 3
    assert tokens_per_verify(PATHS, tree) == 1 + 9 / 4


def test_fit_tree_adds_the_most_frequent_paths_each_after_its_parent() -> None:
    assert fit_tree(PATHS, 1) == {(0,)}
    assert fit_tree(PATHS, 2) == {(0,), (0, 0)}  # (0, 0): 2 starts, (1,): 1
    tree = fit_tree(PATHS, 6)
    assert len(tree) == 6
    assert all(len(p) == 1 or p[:-1] in tree for p in tree)
    # every path is a node of the tree it was fitted to, so each accepts its full depth or more
    assert tokens_per_verify(PATHS, fit_tree(PATHS, 100)) == 4.0


def test_fit_tree_ignores_ranks_past_max_rank() -> None:
    assert fit_tree([[12, 0], [0, 0]], 10, max_rank=10) == {(0,), (0, 0)}
