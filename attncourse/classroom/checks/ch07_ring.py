"""Chapter 07's exercise 2b: one decode step through a rolling buffer (Mistral's sliding-window cache), with a bias
by distance (ALiBi) so that the position each slot holds matters, solutions/07_causal_masks_kv_cache.ipynb.

The step is checked three ways: its output equals a full recompute over every token so far (the window and the bias
applied as masks to the whole history); the trace shows the new key, value and position written in place into slot
``t mod W`` and nowhere else; and nothing but a matrix product reads the buffers (a copy, a reorder, a
concatenation, an elementwise product would each make a new tensor of the cache's size at every step)."""

from __future__ import annotations

import math

import torch

from attncourse.kv_cache import SinkWindowCache
from attncourse.sdpa import scaled_dot_product_attention
from . import Case, exercise

_CACHE = {"arg3": "keys", "arg4": "values"}
_WRITES = ("copy_", "fill_", "index_put_", "index_copy_", "slice_scatter", "select_scatter", "scatter_",
           "masked_scatter_", "index_fill_", "put_", "masked_fill_", "zero_", "add_", "mul_", "sub_", "div_")
_INDEXED = ("index_put_", "index_copy_", "scatter_", "masked_scatter_", "index_fill_", "put_", "masked_fill_")
_VIEWS = ("view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze",
          "squeeze", "alias", "detach", "narrow", "as_strided", "unbind", "split", "chunk", "sym_size", "sym_stride",
          "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "lift_fresh")
_PRODUCTS = ("mm", "bmm", "matmul", "einsum", "baddbmm", "addmm", "mv", "dot", "tensordot", "linear", "addbmm")


def ring_step_reference(q, k_hist, v_hist, slopes, window: int) -> torch.Tensor:
    """Full recompute: the query at position t = T - 1 attends over all T keys of the history (B, H, T, D), those
    more than `window` - 1 back masked out, each score biased by -slope_h * (t - p). (B, H, 1, D)."""
    t = k_hist.shape[2] - 1
    dist = t - torch.arange(t + 1, dtype=k_hist.dtype)  # (T,) distance of each key from the query
    bias = -slopes.to(k_hist.dtype)[:, None, None] * dist  # (H, 1, T)
    bias = bias.masked_fill(dist >= window, float("-inf"))
    return scaled_dot_product_attention(q, k_hist, v_hist, bias)  # (B, H, 1, D)


def _ring_case(name: str, gen: torch.Generator, b: int, h: int, window: int, d: int, t: int, slopes) -> Case:
    """The buffers as a rolling cache leaves them after tokens 0 .. t-1 (slot p mod W holds the newest p of its
    class, -1 marks a slot never written), the new token t, and the full recompute as the expected output."""
    k_hist, v_hist = (torch.randn(b, h, t + 1, d, generator=gen, dtype=torch.float64) for _ in range(2))
    q = torch.randn(b, h, 1, d, generator=gen, dtype=torch.float64)  # (B, H, 1, D)
    cache_k = torch.randn(b, h, window, d, generator=gen, dtype=torch.float64)  # never-written slots: noise
    cache_v = torch.randn(b, h, window, d, generator=gen, dtype=torch.float64)
    slot_pos = torch.full((window,), -1, dtype=torch.long)
    for p in range(max(0, t - window), t):
        cache_k[:, :, p % window], cache_v[:, :, p % window], slot_pos[p % window] = k_hist[:, :, p], v_hist[:, :, p], p
    slopes = torch.tensor(slopes, dtype=torch.float64)
    expected = ring_step_reference(q, k_hist, v_hist, slopes, window)
    args = (q, k_hist[:, :, t:].clone(), v_hist[:, :, t:].clone(), cache_k, cache_v, slot_pos, t, slopes)
    return Case(f"{name}: B={b}, H={h}, W={window}, D={d}, t={t}", args, expected=expected, rtol=1e-6, atol=1e-9)


def _op(name: str) -> str:
    return name.split("::")[-1].split(".")[0]


def _ring_property(runs) -> str | None:
    for run in runs:
        *_, cache_k, _cv, slot_pos, t, _s = run.case.args
        window, d = cache_k.shape[2], cache_k.shape[3]
        slot = t % window
        wrote = {"arg3": False, "arg4": False, "arg5": False}
        for name, _launch, _helper, tensors in run.trace["ops"]:
            op = _op(name)
            target = tensors[0] if tensors else (None, 0, (), ())
            writes = op in _WRITES and target[0] in wrote
            if writes:
                what = _CACHE.get(target[0], "positions")
                if op in _INDEXED:
                    return (f"case '{run.case.name}': the {what} buffer was written through {op} with an index "
                            "tensor; write the one slot by indexing with a Python int, so that the check sees which "
                            "slot you wrote")
                if target[0] in _CACHE:  # a view inside one slot: offset mod W*D in that slot, no span over slots
                    at = target[1] % (window * d) // d
                    spans = window > 1 and any(st == d and n > 1 for n, st in zip(target[2], target[3]))
                else:
                    at, spans = target[1], math.prod(target[2]) > 1
                if at != slot or spans:
                    return (f"case '{run.case.name}': your step wrote into the {what} buffer at slot {at}"
                            f"{' and beyond' if spans else ''}; token t = {t} of a ring of W = {window} slots "
                            f"belongs in slot {slot} and nowhere else: nothing already stored moves")
                wrote[target[0]] = True
            read = tensors[1:] if writes else tensors
            for label, _off, _shape, _stride in read:
                if label in _CACHE and op not in _VIEWS and op not in _PRODUCTS:
                    return (f"case '{run.case.name}': {name} made a new tensor from the cached {_CACHE[label]}: a "
                            "decode step reads the buffer where it lies, with matrix products, in slot order; a copy, "
                            "a reorder or a concatenation costs a cache-sized tensor at every step")
        missing = [("keys", "values", "positions")[i] for i, a in enumerate(("arg3", "arg4", "arg5")) if not wrote[a]]
        if missing:
            return (f"case '{run.case.name}': nothing was written into the {' and '.join(missing)} buffer: the new "
                    "token's entries go into its slot in place, so that the next step finds them there")
    return None


# ----------------------------------------------------------------------------- shortcuts and breakers


def _shortcut_ring_package(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
    """The package's ring buffer around the learner's buffers, and the course's attention: must be refused."""
    b, h, window, d = cache_k.shape
    cache = SinkWindowCache(b, h, d, window=window, n_sink=0)
    cache.k, cache.v, cache.slot_positions, cache.seen = cache_k, cache_v, slot_pos, t
    cache.filled = int((slot_pos >= 0).sum())
    keys, values = cache.update(k, v)  # (B, H, S, D) views, slot order
    dist = (t - cache.positions).to(q.dtype)  # (S,)
    return scaled_dot_product_attention(q, keys, values, -slopes[:, None, None] * dist)


def _shortcut_ring_fused(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
    """PyTorch's fused attention on the buffer: must be refused."""
    slot = int(t) % cache_k.size(2)
    cache_k[:, :, slot], cache_v[:, :, slot], slot_pos[slot] = k[:, :, 0], v[:, :, 0], t
    bias = (-slopes[:, None, None] * (t - slot_pos)).masked_fill(slot_pos < 0, float("-inf"))  # (H, 1, W)
    return torch.nn.functional.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=bias.to(q.dtype))


def _breaker_ring_shift(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
    """Keeps the buffer in temporal order by moving every entry one slot down, then writes the newest last: right
    output, but every step moves the whole cache (and slot t mod W is not where token t goes). Refused."""
    order = slot_pos.argsort()  # oldest first (-1, never written, before all)
    for buf, new in ((cache_k, k), (cache_v, v)):
        ordered = buf[:, :, order]
        buf[:, :, :-1] = ordered[:, :, 1:]
        buf[:, :, -1] = new[:, :, 0]
    pos = slot_pos[order]
    slot_pos[:-1] = pos[1:]
    slot_pos[-1] = t
    logits = torch.matmul(q, cache_k.mT) * q.shape[-1] ** -0.5 - slopes.view(-1, 1, 1) * (t - slot_pos)
    return torch.matmul(logits.masked_fill(slot_pos < 0, float("-inf")).softmax(-1), cache_v)  # (B, H, 1, D)


def _breaker_ring_concat(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
    """Writes the slot, then attends over a reordered copy of the buffer (oldest first): right output, a new
    cache-sized tensor at every step. Refused."""
    slot = int(t) % cache_k.size(2)
    cache_k[:, :, slot], cache_v[:, :, slot], slot_pos[slot] = k[:, :, 0], v[:, :, 0], t
    order = slot_pos.argsort()
    keys, values, pos = cache_k.index_select(2, order), cache_v.index_select(2, order), slot_pos[order]
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]) - slopes[:, None, None] * (t - pos)
    return scores.masked_fill(pos < 0, float("-inf")).softmax(-1) @ values  # (B, H, 1, D)


def _breaker_ring_no_write(q, k, v, cache_k, cache_v, slot_pos, t, slopes):
    """Attends over the buffer and the new token without storing it: right output now, and the next step has lost
    token t. Refused."""
    keep = (slot_pos >= 0) & (t - slot_pos < cache_k.shape[2])  # (W,): the slot t overwrites drops out
    scores = torch.cat([q @ cache_k.transpose(-1, -2), q @ k.transpose(-1, -2)], -1) / math.sqrt(q.shape[-1])
    pos = torch.cat([slot_pos.masked_fill(~keep, -1), torch.tensor([t])])
    scores = (scores - slopes[:, None, None] * (t - pos)).masked_fill(pos < 0, float("-inf"))
    return scores.softmax(-1) @ torch.cat([cache_v, v], 2)  # (B, H, 1, D)


@exercise("07-ring-decode", "ring_decode_step", points=2, category="implement",
          forbid=("attncourse.kv_cache.SinkWindowCache", "attncourse.kv_cache.KVCache",
                  "torch.nn.functional.scaled_dot_product_attention"),
          shortcuts=(_shortcut_ring_package, _shortcut_ring_fused), allow=(), ops=("attention",),
          prop=_ring_property, breakers=(_breaker_ring_shift, _breaker_ring_concat, _breaker_ring_no_write),
          prop_doc="equal to a full recompute over the whole history; the new key, value and position written in "
                   "place into slot t mod W and nowhere else; the buffers read only by matrix products, so a step "
                   "allocates nothing the size of the cache (all seen in the trace)",
          hint="the new token overwrites the slot of the key exactly W positions older; after that, each slot's "
               "stored position gives its distance from the query, for the bias and for the slots never written")
def _ring_decode():
    """One decode step of sliding-window attention with ALiBi through a rolling buffer of W slots."""
    gen = torch.Generator().manual_seed(707)
    cases = [_ring_case("the first token", gen, 1, 1, 4, 3, 0, (0.5,)),
             _ring_case("the buffer filling", gen, 2, 2, 5, 4, 3, (0.25, 0.0)),
             _ring_case("its last empty slot", gen, 2, 3, 5, 4, 4, (0.5, 0.125, 1.0)),
             _ring_case("the first wrap", gen, 1, 2, 5, 4, 5, (0.25, 0.0625)),
             _ring_case("wrapped twice and more", gen, 2, 2, 4, 8, 13, (1.0, 0.03125)),
             _ring_case("a long stream", gen, 1, 4, 6, 4, 40, (0.25, 0.0625, 0.015625, 0.00390625)),
             _ring_case("a window of two", gen, 3, 1, 2, 2, 9, (0.5,))]
    for i in range(3):  # drawn (a salted grader draws others)
        w = int(torch.randint(2, 9, (1,), generator=gen))
        t = int(torch.randint(w, 5 * w, (1,), generator=gen))
        h = int(torch.randint(1, 4, (1,), generator=gen))
        slopes = tuple(float(2.0 ** -torch.randint(0, 6, (1,), generator=gen)) for _ in range(h))
        cases.append(_ring_case(f"drawn {i}", gen, 2, h, w, 4, t, slopes))
    return cases
