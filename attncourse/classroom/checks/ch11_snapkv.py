"""Chapter 11's exercise 8 (solutions/11_long_context.ipynb): SnapKV's keep mask as its reference code computes it, judged
on which keys each head keeps and, on a trained recall model's real attention maps, on the answers the kept cache
still gives.

Expected masks come from :func:`attncourse.kv_compress.snapkv_keep` (``pool="avg", pool_window=False``: the reference
code's average pooling over the earlier keys' votes). A kept set that differs only where two pooled votes tie (to
rounding) is accepted: which of two equal keys a top-k keeps is not the skill.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from attncourse.kv_compress import snapkv_keep
from attncourse.kv_recall import answer_accuracy, prefill_maps, question_batch
from . import Case, exercise


@functools.lru_cache(maxsize=1)
def _trained():
    """Seed 0 of the lesson's trained recall models (notebooks/results/ch11_recall_trained.pt)."""
    from attncourse.kv_recall_trained import RESULTS, new_model

    model = new_model()
    model.load_state_dict(torch.load(RESULTS / "ch11_recall_trained.pt", weights_only=True)["0"])
    return model.eval()


def _pooled(weights, window, kernel):
    """(..., P - window) float64: the earlier keys' votes, averaged over `kernel` neighbours (zeros beyond the ends)."""
    n = weights.shape[-1] - window  # the earlier keys
    votes = weights[..., n:, :n].double().sum(-2)  # (..., n)
    lead = votes.shape[:-1]
    return F.avg_pool1d(votes.reshape(-1, 1, n), kernel, stride=1, padding=kernel // 2).reshape(*lead, n)


def _judge(weights, budget, window, kernel, run=None):
    """A compare: the answer keeps the window and `budget - window` earlier keys whose pooled votes are the largest
    (ties to rounding may go either way); with `run`, the trained model's answers from that cache equal SnapKV's."""
    p = int(weights.shape[-1])  # prompt keys

    def compare(got, expected):
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.shape != expected.shape:
            what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            return f"expected a bool tensor of shape {tuple(expected.shape)} (True = kept), got {what}"
        if torch.equal(got, expected):
            return None
        if budget >= p:
            return f"the budget ({budget}) covers all {p} prompt keys: nothing should be evicted"
        if not got[..., p - window:].all():
            return f"the observation window's own {window} keys (the last ones) must stay in every head's cache"
        counts = got.sum(-1)
        if (counts != budget).any():
            return (f"every head keeps exactly budget = {budget} keys, the window's included; yours keeps between "
                    f"{int(counts.min())} and {int(counts.max())}")
        score, earlier = _pooled(weights, window, kernel), got[..., :p - window]
        lowest_kept = score.masked_fill(~earlier, float("inf")).amin(-1)
        best_dropped = score.masked_fill(earlier, float("-inf")).amax(-1)
        wrong = best_dropped > lowest_kept + 1e-6 * score.abs().amax(-1)
        if wrong.any():
            message = (f"in {int(wrong.sum())} of {wrong.numel()} heads the cache keeps a key that SnapKV drops "
                       f"and drops one it keeps")
            if run is not None:
                message += (f"; on the trained model, the answers given from your cache: {run(got):.3f}, from "
                            f"SnapKV's: {run(expected):.3f}")
            return message
        if run is not None and abs(run(got) - run(expected)) > 0.01:  # a tie broken otherwise cannot move this much
            return f"the trained model answers {run(got):.3f} from your cache, {run(expected):.3f} from SnapKV's"
        return None

    return compare


def _causal_maps(gen, shape, dtype=torch.float64, sharpen=1.0):
    scores = torch.randn(*shape, generator=gen, dtype=torch.float64) * sharpen  # (..., P, P)
    causal = torch.ones(shape[-1], shape[-1], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1).to(dtype)


def _shortcut_package(weights, budget, window, kernel):
    return snapkv_keep(weights, budget, window, kernel, pool="avg", pool_window=False)


@exercise("11-snapkv-keep", "snapkv_mask", points=2, category="implement",
          forbid=("attncourse.kv_compress.snapkv_keep", "attncourse.kv_compress.h2o_keep",
                  "attncourse.kv_compress._keep_top", "attncourse.kv_recall.keep_masks"),
          allow=(), ops=(),
          prop_doc="the kept set is the output: the cases separate the observation window's vote from the whole "
                   "prompt's (H2O's), average pooling from none and from max, pooling the earlier keys alone from "
                   "pooling the window's keys too, zero padding counted from not counted, and one head from another; "
                   "on a trained model's real attention maps the kept set is also judged by the answers it leaves",
          shortcuts=(_shortcut_package,),
          hint="per head: which queries vote, over which keys are their votes smoothed, what stands beyond the ends "
               "of those keys, and how many keys does the window leave for the vote to choose?")
def _snapkv_keep():
    """SnapKV's keep mask: the observation window's vote, pooled, top-k, on random maps and a trained model's."""
    gen = torch.Generator().manual_seed(53)
    cases = []

    def add(name, weights, budget, window, kernel, run=None):
        expected = snapkv_keep(weights, budget, window, kernel, pool="avg", pool_window=False)
        cases.append(Case(f"{name}: weights {tuple(weights.shape)}, budget {budget}, window {window}, kernel {kernel}",
                          (weights, budget, window, kernel), expected=expected,
                          compare=_judge(weights, budget, window, kernel, run)))

    add("random causal maps", _causal_maps(gen, (2, 3, 20, 20)), 8, 3, 5)
    add("no pooling (kernel 1)", _causal_maps(gen, (1, 2, 16, 16), sharpen=2.0), 6, 2, 1)
    early = _causal_maps(gen, (1, 2, 18, 18))
    early[..., 4:12, 4] += 2.0  # the early queries pile onto key 4, the window's queries do not: H2O keeps it
    early[..., 14:, 9] += 0.3
    add("the early queries and the window vote for different keys", early / early.sum(-1, keepdim=True), 6, 4, 3)
    own = _causal_maps(gen, (2, 2, 24, 24))
    own[..., 19:, 19:] *= 8.0  # the window's queries read the window: pooling across its keys lifts its neighbours
    add("the window reads itself", own / own.sum(-1, keepdim=True), 7, 5, 5)
    edge = _causal_maps(gen, (1, 3, 22, 22), sharpen=0.2)
    edge[..., 19:, 0] += 0.9  # a strong vote on the first key: the zeros beyond the start count in its average
    edge[..., 19:, 9:12] += 0.35
    add("a strong vote at the first key", edge / edge.sum(-1, keepdim=True), 6, 3, 5)
    add("budget = window: only the window stays", _causal_maps(gen, (1, 2, 10, 10)), 3, 3, 3)
    add("budget above the prompt: nothing evicted", _causal_maps(gen, (2, 1, 9, 9)), 12, 2, 5)
    add("float32, heads that differ, kernel 7", _causal_maps(gen, (1, 4, 64, 64), torch.float32, 1.5), 20, 8, 7)
    model = _trained()
    tokens, prompt, answers = question_batch(torch.Generator().manual_seed(61), 64)
    maps = prefill_maps(model, tokens, prompt)  # per layer (64, 2, 36, 36)

    def run(keep):  # keep (layers, B, H, P) -> answer accuracy of the trained model from that cache
        return answer_accuracy(model, tokens, prompt, answers, maps=maps, keeps=list(keep.unbind(0)))["accuracy"]

    stacked = torch.stack(maps)  # (layers, B, H, P, P): every layer's maps at once
    for kernel, budget in ((5, 6), (1, 6), (5, 12)):
        add(f"the trained recall model of the lesson (seed 0), 64 prompts, layers stacked", stacked, budget, 3, kernel,
            run)
    return cases
