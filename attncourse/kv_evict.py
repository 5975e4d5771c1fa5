r"""KV-cache eviction at every decode step: H2O as its paper runs it, and a sliding window of the newest keys, both
under a cache that never holds more than `budget` keys per layer and head.

H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
Algorithm 1, and the authors' ``H2OKVCache_LayerWise`` in FMInference/H2O) is a *greedy, decode-time* policy. After
the prefill, every prompt key is scored by the attention the prompt's queries gave it (summed over the queries) and
the cache is trimmed to the `recent` newest keys plus the best-scored others (what :func:`kv_compress.h2o_keep` does,
once). Then, at every decode step, the new token's key joins the cache, the step's query attends to the cache, its
attention weights are **added** to each cached key's score, and the key with the lowest accumulated score outside
the recent window is evicted. An evicted key never returns. :func:`kv_compress.compressed_eval`'s ``"h2o"`` is the
one-shot variant: the prompt is trimmed once and the scores are never updated (the decoded keys are all kept).

:func:`decode_eval` runs a model's continuation under either policy, teacher-forced (:func:`free_running` feeds the
model's own tokens back instead): layer by layer, each decode
query sees exactly the keys its layer's cache holds at that step (built as a per-query mask, so one forward per layer
and step gives what a token-by-token decode gives; ``tests/test_kv_evict.py`` checks it against such a decode).
"""

from __future__ import annotations

import torch

from . import _validate
from .kv_compress import h2o_keep

__all__ = ["decode_eval", "evict_one", "free_running"]


def evict_one(keep: torch.Tensor, score: torch.Tensor, step: int, budget: int, recent: int, policy: str,
              sinks: int = 0) -> torch.Tensor:
    """The cache after one eviction where it holds more than `budget` keys (per row of `keep`).

    keep: bool (..., S) the cached keys (the step's own key included); score: (..., S) accumulated attention;
    step: the position of the step's key. "h2o" drops the lowest-scored key older than the `recent` newest
    positions; "window" drops the oldest key. Keys at positions below `sinks` are never dropped (StreamingLLM's
    sink tokens: "window" with sinks is StreamingLLM's cache). Returns the new bool (..., S)."""
    over = keep.sum(-1) > budget  # (...,)
    if not bool(over.any()):
        return keep
    pos = torch.arange(keep.shape[-1], device=keep.device)
    if policy == "h2o":
        candidates = keep & (pos <= step - recent) & (pos >= sinks)  # outside the recent window and the sinks
        victim = score.masked_fill(~candidates, float("inf")).argmin(-1)  # (...,)
    else:
        victim = torch.where(keep & (pos >= sinks), pos, keep.shape[-1]).argmin(-1)  # the oldest non-sink key
    drop = torch.zeros_like(keep).scatter(-1, victim[..., None], True) & over[..., None]
    return keep & ~drop


def decode_eval(model, tokens: torch.Tensor, prompt_len: int, policy: str = "h2o", *, budget: int,
                recent: int = 4, sinks: int = 0) -> dict:
    """Next-token accuracy of the decode steps (queries at positions prompt_len .. T-2, teacher-forced) when every
    layer and head keeps at most `budget` keys in its cache, evicting at every step by `policy`.

    model: an :class:`~attncourse.heads.AttnOnlyTransformer` (softmax attention). tokens: (B, T) ids.
    policy: "h2o" (heavy hitters by accumulated attention, plus the `recent` newest keys) or "window" (the `budget`
    newest keys). The prompt is prefilled with full causal attention; its cache is then trimmed to `budget` keys
    (H2O: :func:`kv_compress.h2o_keep` on the prefill's maps; window: the newest). Each decode step adds its own
    key, attends, scores, and evicts one key when the cache is over budget. `sinks`: the first `sinks` positions
    stay cached whatever their score or age, inside the budget ("window" with sinks is StreamingLLM's cache). Kept
    keys keep the positions they were computed at (as H2O does; StreamingLLM re-indexes, chapter 07). Returns ``{"accuracy", "per_step"
    (accuracy of each decode step over the batch), "max_keys" (the most keys one head's cache held after a step),
    "logits" (B, T, V), "kept" (per layer, bool (B, H, T): the positions cached after the last step)}``.
    Raises ValueError for an unknown policy, `recent` outside 1..budget or a prompt that leaves no continuation."""
    if policy not in ("h2o", "window"):
        raise ValueError(f"policy must be 'h2o' or 'window', got {policy!r}")
    _validate.tensor("tokens", tokens, min_rank=2)
    _validate.positive_int("budget", budget)
    _validate.positive_int("recent", recent)
    if recent > budget:
        raise ValueError(f"recent={recent} must be at most budget={budget}")
    room = budget - (recent if policy == "h2o" else 1)  # the step's own key always joins
    if not isinstance(sinks, int) or isinstance(sinks, bool) or not 0 <= sinks <= min(room, prompt_len):
        raise ValueError(f"sinks must be an int in 0..{min(room, prompt_len)} for budget={budget}, got {sinks!r}")
    b, t = tokens.shape
    if not 1 <= prompt_len < t - 1:
        raise ValueError(f"prompt_len must leave a continuation: 1 <= prompt_len < T - 1 = {t - 1}, got {prompt_len}")
    most, final = 0, []
    with torch.no_grad():
        x = model.tok(tokens) + model.pos(torch.arange(t))  # (B, T, d)
        for norm, attn in zip(model.norms, model.attns):
            h = norm(x)
            heads = attn.n_heads
            mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, heads, t, t).clone()  # (B, H, T, T)
            _, w = attn(h[:, :prompt_len], is_causal=True, return_weights=True)  # (B, H, P, P): the prefill
            score = torch.zeros(b, heads, t, dtype=w.dtype)
            score[..., :prompt_len] = w.sum(-2)  # attention each prompt key received from the prompt
            keep = torch.zeros(b, heads, t, dtype=torch.bool)
            kept = min(budget, prompt_len)
            if policy == "h2o":
                keep[..., :prompt_len] = h2o_keep(w, kept, min(recent, kept), min(sinks, kept - min(recent, kept)))
            else:
                keep[..., prompt_len - kept + sinks:prompt_len] = True
                keep[..., :sinks] = True
            for s in range(prompt_len, t - 1):  # decode step: the query at position s
                keep[..., s] = True  # its own key joins the cache
                mask[:, :, s] = keep  # (B, H, T): what this query may read
                _, w = attn(h[:, :s + 1], attn_mask=mask[:, :, :s + 1, :s + 1], return_weights=True)
                score[..., :s + 1] += w[:, :, s]  # (B, H, s+1): this step's weights join the scores
                keep = evict_one(keep, score, s, budget, recent, policy, sinks)
                most = max(most, int(keep.sum(-1).max()))
            x = x + attn(h, attn_mask=mask)
            final.append(keep)
        logits = model.head(model.norm(x))  # (B, T, V)
    hits = (logits[:, prompt_len:-1].argmax(-1) == tokens[:, prompt_len + 1:]).double()  # (B, decode steps)
    return {"accuracy": hits.mean().item(), "per_step": hits.mean(0).tolist(), "max_keys": most, "logits": logits,
            "kept": final}


def free_running(evaluate, tokens: torch.Tensor, prompt_len: int) -> dict:
    """The same evaluation decoded for real: the model's own greedy token is fed back at every step.

    `evaluate(seq)` runs one teacher-forced evaluation on (B, T) ids and returns a dict with "logits" (B, T, V), as
    :func:`decode_eval`, :func:`kv_compress.compressed_eval` and :func:`quest.quest_eval` do. Step by step, the
    argmax at position s becomes token s + 1 (the first continuation token comes from the prefill, as in the
    teacher-forced run), and the whole evaluation is run again on the new sequence, so a policy that looks at the
    continuation (H2O's scores, Quest's pages) sees the tokens the model decoded, not the true ones. Returns
    ``{"accuracy", "per_step", "tokens" (the decoded sequence)}``: the share of decoded tokens that equal the true
    continuation, over the same positions the teacher-forced accuracy scores."""
    _validate.tensor("tokens", tokens, min_rank=2)
    b, t = tokens.shape
    if not 1 <= prompt_len < t - 1:
        raise ValueError(f"prompt_len must leave a continuation: 1 <= prompt_len < T - 1 = {t - 1}, got {prompt_len}")
    seq = tokens.clone()
    for s in range(prompt_len, t - 1):
        seq[:, s + 1] = evaluate(seq)["logits"][:, s].argmax(-1)  # causal: positions <= s are final already
    hits = (seq[:, prompt_len + 1:] == tokens[:, prompt_len + 1:]).double()  # (B, decode steps)
    return {"accuracy": hits.mean().item(), "per_step": hits.mean(0).tolist(), "tokens": seq}
