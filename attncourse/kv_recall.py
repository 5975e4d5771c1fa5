r"""A KV-compression test bed where eviction can work: associative recall with the question at the end of the prompt.

SnapKV's premise (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", section 3) is that
the end of the prompt, the user's question, already attends to the keys the answer will need, so a vote of those
last queries picks them. The prompts here have that shape: ``k1 v1 k2 v2 ... kN vN`` (distinct keys, random values;
the multi-query associative recall layout of Zoology, Arora et al. 2023), a separator, then the question:
``n_queries`` of the keys. The continuation asks them one at a time, ``q1 a1 q2 a2 ...``, and only the answers are
scored (each query token is given, as in MQAR). Everything the answers need sits in ``n_queries`` value positions of
the prompt, so a cache that keeps those few keys can answer from a fraction of the prompt, and one that keeps the
wrong fraction cannot.

:func:`question_batch` builds the tokens, :func:`planted_recall_model` is chapter 12's hand-set induction circuit
adapted to them, :func:`keep_masks` applies one eviction policy to the prefill's attention maps (H2O's and SnapKV's
selections are :mod:`attncourse.kv_compress`'s), and :func:`answer_accuracy` decodes the answers from the compressed
cache, teacher-forced or with the model's own answers fed back.
"""
from __future__ import annotations

import torch

from . import _validate
from .heads import AttnOnlyTransformer, planted_induction_model
from .kv_compress import h2o_keep, snapkv_keep

__all__ = ["question_batch", "planted_recall_model", "keep_masks", "prefill_maps", "answer_accuracy", "POLICIES"]

N_PAIRS, N_QUERIES, N_KEYS = 16, 3, 16
POLICIES = ("full", "snapkv", "h2o", "recent", "random")


def question_batch(generator: torch.Generator, batch: int, n_pairs: int = N_PAIRS, n_queries: int = N_QUERIES,
                   n_keys: int = N_KEYS) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Tokens (batch, 2N + 1 + 3m): ``k1 v1 ... kN vN SEP q1 .. qm | q1 a1 .. qm am``; keys are ids [0, n_keys),
    values [n_keys, 2 n_keys), SEP is 2 n_keys; the m queries are distinct keys of the prompt. Returns (tokens,
    prompt length 2N + 1 + m, answer positions (m,)). Raises ValueError for sizes that are not positive ints, more
    pairs than keys or more queries than pairs."""
    for name, x in (("batch", batch), ("n_pairs", n_pairs), ("n_queries", n_queries), ("n_keys", n_keys)):
        _validate.positive_int(name, x)
    if n_pairs > n_keys or n_queries > n_pairs:
        raise ValueError(f"need n_queries <= n_pairs <= n_keys, got {n_queries}, {n_pairs}, {n_keys}")
    keys = torch.rand(batch, n_keys, generator=generator).argsort(-1)[:, :n_pairs]  # (B, N) distinct
    values = torch.randint(0, n_keys, (batch, n_pairs), generator=generator) + n_keys  # (B, N)
    which = torch.rand(batch, n_pairs, generator=generator).argsort(-1)[:, :n_queries]  # (B, m) distinct pairs
    q, a = keys.gather(1, which), values.gather(1, which)  # (B, m) each
    sep = torch.full((batch, 1), 2 * n_keys)
    pairs = torch.stack([keys, values], -1).flatten(1)  # (B, 2N)
    tokens = torch.cat([pairs, sep, q, torch.stack([q, a], -1).flatten(1)], 1)
    prompt = 2 * n_pairs + 1 + n_queries
    return tokens, prompt, prompt + 1 + 2 * torch.arange(n_queries)


def planted_recall_model(n_keys: int = N_KEYS, n_pairs: int = N_PAIRS, n_queries: int = N_QUERIES, *,
                         generator: torch.Generator | None = None, noise: float = 0.1) -> AttnOnlyTransformer:
    """Chapter 12's hand-set induction circuit (:func:`~attncourse.heads.planted_induction_model`) made a recall
    circuit for these prompts: its induction head (1, 0) also scores a key half as high when the key's own token is a
    *value*, so a query token finds the value after its earlier occurrence in the pairs, not the next question token
    after its occurrence in the question (both follow it). The weights are set, not learned: what the
    circuit needs from the cache is known exactly, 1 value position per question key."""
    length = 2 * n_pairs + 1 + 3 * n_queries
    model = planted_induction_model(2 * n_keys + 1, (length + 1) // 2, generator=generator, noise=noise)
    a, width = model.attns[1], model.attns[1].head_dim
    tok, extra = 0, 2 * n_keys + 1  # the token slot of the residual stream; a free row of head (1, 0)'s q and k
    if extra >= width:
        raise ValueError(f"n_keys={n_keys} leaves no free query row in a head of width {width}")
    with torch.no_grad():
        sharp = a.q_proj.weight[0, tok].item()  # the circuit's query scale
        a.q_proj.weight[extra, tok:tok + n_keys] = sharp / 2  # every key token asks for "a value"...
        a.k_proj.weight[extra, tok + n_keys:tok + 2 * n_keys] = 1.0  # ...which every value token's key answers
    return model.eval()


def keep_masks(maps: list[torch.Tensor], policy: str, budget: int | None = None, *, window: int = N_QUERIES,
               kernel: int = 5, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Per layer, bool (B, H, P): the prompt keys each head keeps after the prefill. `maps`: the prefill's attention
    maps, (B, H, P, P) per layer. `policy`: "full"; "snapkv" (:func:`~attncourse.kv_compress.snapkv_keep`, the last
    `window` queries voting, average pooling over `kernel` keys: 5 in the reference code, 1 for none); "h2o"
    (:func:`~attncourse.kv_compress.h2o_keep`, `window` recent keys); "recent" (the last `budget` keys: a sliding
    window cut at the prefill); "random" (the last `window` keys and `budget - window` others drawn uniformly from
    `generator`). Raises ValueError for an
    unknown policy, or a budget missing or not in window..P."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(maps, (list, tuple)) or not maps:
        raise TypeError("maps must be a non-empty list of (B, H, P, P) attention maps")
    p = maps[0].shape[-1]
    if policy != "full" and (not isinstance(budget, int) or not window <= budget <= p):
        raise ValueError(f"policy {policy!r} needs an int budget in {window}..{p} (window..prompt), got {budget!r}")
    out = []
    for m in maps:
        if policy == "full":
            keep = torch.ones(m.shape[:-1], dtype=torch.bool)
        elif policy == "snapkv":
            keep = snapkv_keep(m, budget, window, kernel, pool="avg")
        elif policy == "h2o":
            keep = h2o_keep(m, budget, window)
        elif policy == "recent":
            keep = torch.zeros(m.shape[:-1], dtype=torch.bool)
            keep[..., p - budget:] = True
        else:
            keep = torch.zeros(m.shape[:-1], dtype=torch.bool)
            keep[..., p - window:] = True
            draw = torch.rand(m.shape[:-1], generator=generator)[..., :p - window]  # (B, H, P - window)
            keep.scatter_(-1, draw.topk(budget - window, -1).indices, True)
        out.append(keep)
    return out


def prefill_maps(model, tokens: torch.Tensor, prompt_len: int) -> list[torch.Tensor]:
    """The prefill's attention maps, (B, H, P, P) per layer: what every policy selects from."""
    with torch.no_grad():
        return model(tokens[:, :prompt_len], return_weights=True)[1]


def answer_accuracy(model, tokens: torch.Tensor, prompt_len: int, answers: torch.Tensor, policy: str = "full",
                    budget: int | None = None, *, window: int = N_QUERIES, kernel: int = 5, decoded: bool = False,
                    generator: torch.Generator | None = None, maps: list[torch.Tensor] | None = None,
                    keeps: list[torch.Tensor] | None = None) -> dict:
    """Answer accuracy when every layer's prompt keys are cut by `policy` after the prefill (:func:`keep_masks`);
    the continuation's queries see the kept prompt keys and every continuation key. Teacher-forced, or with
    ``decoded=True`` each answer is the model's own greedy token, fed back before the next query. `window`: the
    observation window (SnapKV) or recent keys (H2O, random); `kernel`: SnapKV's pooling width; `maps`: the
    prefill's attention maps, if :func:`prefill_maps` computed them already (one prefill for many policies);
    `keeps`: per layer, bool (B, H, P) kept prompt keys chosen elsewhere, in place of `policy`'s. Returns ``{"accuracy", "per_answer" (m,), "pred" (B, m) the answers given, "kept" (mean prompt keys kept per
    head)}``."""
    _validate.tensor("tokens", tokens, min_rank=2)
    b, t = tokens.shape
    with torch.no_grad():
        if maps is None:
            maps = prefill_maps(model, tokens, prompt_len)
        if keeps is None:
            keeps = keep_masks(maps, policy, budget, window=window, kernel=kernel, generator=generator)
        elif len(keeps) != len(maps) or any(k.shape != m.shape[:-1] or k.dtype != torch.bool
                                            for k, m in zip(keeps, maps)):
            raise ValueError(f"keeps must hold one bool (B, H, P) mask per layer, like the maps' "
                             f"{[tuple(m.shape[:-1]) for m in maps]}, got {[tuple(k.shape) for k in keeps]}")
        masks = []
        for keep in keeps:
            allowed = torch.ones(b, keep.shape[1], t, t, dtype=torch.bool).tril()
            allowed[:, :, prompt_len:, :prompt_len] &= keep[:, :, None, :]
            masks.append(allowed)

        def run(seq):
            x = model.tok(seq) + model.pos(torch.arange(t))
            for norm, attn, mask in zip(model.norms, model.attns, masks):
                x = x + attn(norm(x), attn_mask=mask)
            return model.head(model.norm(x))  # (B, T, V)

        seq = tokens.clone()
        if decoded:  # causal: answer j only changes what comes after it
            for pos in answers.tolist():
                seq[:, pos] = run(seq)[:, pos - 1].argmax(-1)
            pred = seq[:, answers]
        else:
            pred = run(seq)[:, answers - 1].argmax(-1)
    hits = (pred == tokens[:, answers]).double()  # (B, m)
    kept = sum(k.double().sum(-1).mean().item() for k in keeps) / len(keeps)
    return {"accuracy": hits.mean().item(), "per_answer": hits.mean(0).tolist(), "pred": pred, "kept": kept}
