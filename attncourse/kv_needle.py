r"""A needle-in-a-haystack grid on the recall circuit: answer accuracy by needle depth and context length.

KV-compression papers draw this figure (SnapKV, Li et al. 2024, runs it on LWM-Text-Chat-1M; the test is Kamradt's
"needle in a haystack", and RULER, Hsieh et al. 2024, generalises it): a fact placed at some depth of a
long prompt, a question about it at the end, and the answer scored for every (depth, length) cell. Here the
haystack is :mod:`attncourse.kv_recall`'s key-value pairs, the needle is the one pair the question asks about, and
the model is the hand-set recall circuit, so a cell's accuracy says only whether the cache still holds the needle's
value for the question's query, not how well a model reads.

:func:`needle_batch` places the asked pair at a chosen depth; :func:`needle_cell` scores one cell for a cache
policy at a fixed budget of keys per head: ``"full"``, ``"window"`` (the newest `budget` prompt keys, cut after the
prefill), ``"h2o"`` (the heavy hitters of the prefill's summed attention and the newest key,
:func:`~attncourse.kv_compress.h2o_keep`), ``"snapkv"`` (the question's vote,
:func:`~attncourse.kv_compress.snapkv_keep`, cut after the prefill) or
``"quest"`` (nothing evicted; the answer's query reads ``budget // page_size - 1`` pages by Quest's bound besides
its own, :func:`~attncourse.quest.quest_eval`).
"""
from __future__ import annotations

import torch

from . import _validate
from .kv_recall import answer_accuracy, planted_recall_model, prefill_maps
from .quest import quest_eval

__all__ = ["needle_batch", "needle_cell", "NEEDLE_POLICIES"]

NEEDLE_POLICIES = ("full", "window", "h2o", "snapkv", "quest")


def needle_batch(generator: torch.Generator, batch: int, n_pairs: int, depth: float
                 ) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Tokens (batch, 2N + 4): ``k1 v1 ... kN vN SEP q | q a`` with distinct keys in [0, N), values in [N, 2N), SEP
    = 2N, and the asked pair the one at index ``round(depth (N - 1))`` (depth 0: the first pair, 1: the last).
    Returns (tokens, prompt length 2N + 2, answer position (1,)). Raises ValueError for a depth outside [0, 1] or
    sizes that are not positive ints."""
    _validate.positive_int("batch", batch)
    _validate.positive_int("n_pairs", n_pairs)
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    keys = torch.rand(batch, n_pairs, generator=generator).argsort(-1)  # (B, N): distinct keys
    values = torch.randint(0, n_pairs, (batch, n_pairs), generator=generator) + n_pairs  # (B, N)
    at = round(depth * (n_pairs - 1))
    q, a = keys[:, at:at + 1], values[:, at:at + 1]  # (B, 1) each
    sep = torch.full((batch, 1), 2 * n_pairs)
    tokens = torch.cat([torch.stack([keys, values], -1).flatten(1), sep, q, q, a], 1)
    prompt = 2 * n_pairs + 2
    return tokens, prompt, torch.tensor([prompt + 1])


NOISE = 0.03  # the circuit's random heads: at chapter 12's 0.1 their noise, which grows with the model's width,
# already costs the full cache answers at 64 pairs (d_model 520); at 0.03 the full cache answers every cell


def needle_cell(seed: int, n_pairs: int, depth: float, policies=NEEDLE_POLICIES, budget: int = 8, *,
                batch: int = 32, page_size: int = 4, kernel: int = 5) -> dict:
    """Answer accuracy of one (depth, length) cell for each policy: the recall circuit drawn with `seed`, `batch`
    prompts of `n_pairs` pairs with the needle at `depth`, the prompt's cache under each policy at `budget` keys per
    head (in every layer). SnapKV votes with the question's query alone and average-pools over `kernel` keys (5, as
    the reference code). Returns {policy: accuracy}. Raises ValueError for an unknown policy or a budget Quest
    cannot split into whole pages."""
    policies = (policies,) if isinstance(policies, str) else tuple(policies)
    for policy in policies:
        if policy not in NEEDLE_POLICIES:
            raise ValueError(f"policy must be one of {NEEDLE_POLICIES}, got {policy!r}")
    _validate.positive_int("budget", budget)
    if "quest" in policies and (budget % page_size or budget < 2 * page_size):
        raise ValueError(f"quest needs a budget of at least two whole pages of {page_size}, got {budget}")
    model = planted_recall_model(n_pairs, n_pairs, 1, generator=torch.Generator().manual_seed(seed), noise=NOISE)
    tokens, prompt, answer = needle_batch(torch.Generator().manual_seed(1000 * seed + n_pairs + round(100 * depth)),
                                          batch, n_pairs, depth)
    maps = prefill_maps(model, tokens, prompt) if {"window", "h2o", "snapkv"} & set(policies) else None
    out = {}
    for policy in policies:
        if policy == "quest":
            out[policy] = quest_eval(model, tokens, prompt, page_size=page_size,
                                     pages=budget // page_size - 1)["accuracy"]
        elif policy == "full":
            out[policy] = answer_accuracy(model, tokens, prompt, answer)["accuracy"]
        else:
            out[policy] = answer_accuracy(model, tokens, prompt, answer, "recent" if policy == "window" else policy,
                                          min(budget, prompt), window=1, kernel=kernel, maps=maps)["accuracy"]
    return out


GRID = dict(seeds=(0, 1, 2), pairs=(8, 16, 32, 64), depths=(0.0, 0.25, 0.5, 0.75, 1.0), budget=8)


def needle_grid(seeds=GRID["seeds"], pairs=GRID["pairs"], depths=GRID["depths"], budget: int = GRID["budget"]
                ) -> dict:
    """Every cell of the grid: {"acc": {policy: [seed][length][depth]}, and the grid's settings}."""
    acc = {p: [[[0.0] * len(depths) for _ in pairs] for _ in seeds] for p in NEEDLE_POLICIES}
    for i, seed in enumerate(seeds):
        for j, n in enumerate(pairs):
            for k, depth in enumerate(depths):
                for policy, a in needle_cell(seed, n, depth, NEEDLE_POLICIES, budget).items():
                    acc[policy][i][j][k] = a
    return {"seeds": list(seeds), "pairs": list(pairs), "prompt_tokens": [2 * n + 2 for n in pairs],
            "depths": list(depths), "budget": budget, "noise": NOISE, "acc": acc}


if __name__ == "__main__":  # python -m attncourse.kv_needle: the stored grid of lesson 11 (a few CPU minutes)
    import json
    from pathlib import Path

    torch.set_num_threads(1)
    out = Path(__file__).resolve().parent.parent / "notebooks" / "results" / "ch11_needle.json"
    out.write_text(json.dumps(needle_grid(), indent=1) + "\n")
    print("wrote", out)
