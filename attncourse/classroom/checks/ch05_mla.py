"""Exercise 05-mla-absorbed-decode (solutions/05_mqa_gqa.ipynb, exercise 9): one decode step of multi-head latent
attention from its cache, with the up-projections absorbed. Its property, judged from the operators the answer ran:
the cache is never expanded into per-head keys or values, never copied per head, and read as MQA reads its one KV
head; and the answers that break it."""

from __future__ import annotations

import math

import torch

from attncourse.mla import MLACache, MultiHeadLatentAttention
from attncourse.positions import apply_rope
from . import Case, exercise
from .kv_copies import _MATMUL_OPS, _VIEW_OPS, _matmul_flops, _numel, _op_name


def _sizes(case) -> tuple[int, ...]:
    q_nope, q_rope, c_kv = case.args[:3]
    (b, h, dn), dr, (s, r) = q_nope.shape, q_rope.shape[-1], c_kv.shape[1:]
    return b, h, dn, dr, s, r


def _absorbed_macs(b, h, dn, dr, s, r) -> int:
    """Multiply-adds of the absorbed step: W_UK into the queries, scores over the r + dr wide cache, the latents
    mixed, W_UV after."""
    return b * h * dn * r + b * h * s * (r + dr) + b * h * s * r + b * h * r * dn


def _cache_read_once(runs) -> str | None:
    """The latent cache is read where it is, as MQA reads its one KV head: no operator receives a tensor holding the
    S cached positions that is larger than the cache with its RoPE key (B, S, r + dr) or the scores (B, H, S) (a copy
    of the latent or of the RoPE key per head, keys or values expanded per head, a product broadcast over the heads
    before a sum); the matmuls read the latent twice (as key and as value) and the RoPE key once in all, not once
    per head; the operators other than views and matmuls move the cache at most three times over; and the matmuls do
    no more than 1.5 times the absorbed step's multiply-adds (expanding the S latents through W_UK or W_UV costs
    about head_dim times more). Judged on the cases with 8 or more heads and 16 or more cached tokens, whose sizes
    are chosen so that no other tensor has the cache's shape."""
    for run in runs:
        b, h, dn, dr, s, r = _sizes(run.case)
        if h < 8 or s < 16:
            continue
        limit = max(b * s * (r + dr), b * h * s)
        widths = {r: "latent", dr: "RoPE key", r + dr: "latent and RoPE key"}
        read = {"latent": 0, "RoPE key": 0}
        moved, macs = 0, 0
        for name, _launch, _helper, tensors in run.trace["ops"]:
            op = _op_name(name)
            for label, _offset, shape, stride in tensors:
                n = _numel(shape)
                if s in shape and n > limit and not (op in _VIEW_OPS and 0 in stride):
                    return (f"case {run.case.name!r}: {name} received a tensor of shape {tuple(shape)}, "
                            f"{n / (b * s * (r + dr)):.3g} times the cache: the latent or the RoPE key was copied or "
                            "expanded for every head. Every head should read the one cache where it is")
            if op in _VIEW_OPS:
                continue
            cache_shaped = [(shape, widths[int(shape[-1] if shape[-2] == s else shape[-2])]) for _l, _o, shape, _s
                            in tensors if len(shape) >= 2 and ((shape[-2] == s and shape[-1] in widths) or
                                                               (shape[-1] == s and shape[-2] in widths))]
            if op in _MATMUL_OPS:
                macs += _matmul_flops(tensors)
                for shape, part in cache_shaped:
                    rows = _numel(shape) // (r + dr) if part == "latent and RoPE key" else None
                    if rows is None:
                        read[part] += _numel(shape)
                    else:
                        read["latent"], read["RoPE key"] = read["latent"] + rows * r, read["RoPE key"] + rows * dr
            else:
                moved += sum(_numel(shape) for shape, _part in cache_shaped)
        latent, rope = b * s * r, b * s * dr
        if read["latent"] > 1.5 * 2 * latent or read["RoPE key"] > 1.5 * rope:
            return (f"case {run.case.name!r}: the matmuls read the latent {read['latent'] / latent:.3g} times and the "
                    f"RoPE key {read['RoPE key'] / rope:.3g} times: the cache was read once per head (a loop over "
                    "the heads does this without any copy). Absorbed MLA is MQA: fold the heads into the query axis "
                    "so that one matmul reads the cache for all of them")
        if moved > 3 * (latent + rope):
            return (f"case {run.case.name!r}: operators other than views and matmuls moved "
                    f"{moved / (latent + rope):.3g} times the cache: it was copied per head")
        absorbed = _absorbed_macs(b, h, dn, dr, s, r)
        if macs > 1.5 * absorbed:
            return (f"case {run.case.name!r}: the matmuls did {macs:,} multiply-adds where the absorbed step needs "
                    f"{absorbed:,}: the cached latents were expanded into per-head keys or values. Move W_UK to the "
                    "query side and apply W_UV after the weighted sum")
    return None


# ----------------------------------------------------------------------------- the reference and its cases


def _module(gen: torch.Generator, h: int, r: int, dr: int, dn: int) -> MultiHeadLatentAttention:
    """A float64 MLA layer with seeded weights and W_O the identity (so its output is the heads' outputs side by
    side)."""
    mla = MultiHeadLatentAttention(h * dn, h, kv_rank=r, head_dim=dn, rope_dim=dr).double()
    with torch.no_grad():
        for p in mla.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[-1]))
        mla.o_proj.weight.copy_(torch.eye(h * dn, dtype=torch.float64))
    return mla


def decode_step_reference(mla: MultiHeadLatentAttention, x: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """The exercise's inputs for the last token of x (B, S, d) as the next decode step of `mla`, and the expanded
    module's output for it, (B, H, head_dim) (the checker's reference: ``absorbed=False``)."""
    b, s, _ = x.shape
    h, dn, dr, r = mla.n_heads, mla.head_dim, mla.rope_dim, mla.kv_rank
    cache = MLACache()
    with torch.no_grad():
        if s > 1:
            mla(x[:, :-1], kv_cache=cache)  # prefill the first S - 1 tokens
        expected = mla(x[:, -1:], kv_cache=cache, is_causal=True).view(b, h, dn)  # (B, 1, H*dn) -> (B, H, dn)
        q = mla.q_proj(x[:, -1:]).view(b, h, 1, dn + dr)  # (B, H, 1, dn + dr): the new token's query per head
        q_rope = apply_rope(q[..., dn:], torch.tensor([s - 1]), inv_freq=mla.inv_freq)  # rotated at position S - 1
        args = (q[:, :, 0, :dn].clone(), q_rope[:, :, 0].clone(), cache.c_kv.clone(), cache.k_rope.clone(),
                mla.k_up.weight.view(h, dn, r).clone(), mla.v_up.weight.view(h, dn, r).clone())
    return args, expected


# (B, H, kv_rank r, rope_dim, head_dim, S cached positions including the new token's)
MLA_DECODE_CASES = {"batch 2, 8 heads, latent 16, RoPE key 6, heads of 12, 40 cached": (2, 8, 16, 6, 12, 40),
                    "batch 3, 8 heads, latent 24, RoPE key 4, heads of 10, 29 cached": (3, 8, 24, 4, 10, 29),
                    "batch 2, 16 heads, latent 32, RoPE key 8, heads of 12, 50 cached": (2, 16, 32, 8, 12, 50),
                    "batch 1, 4 heads, latent 8, RoPE key 2, heads of 6, the new token alone": (1, 4, 8, 2, 6, 1)}


# ----------------------------------------------------------------------------- right outputs by refused routes


def _shortcut_sdpa_mqa(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):  # the lesson's "absorbed MLA is MQA" cell
    q = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_rope], -1)[:, :, None]  # (B, H, 1, r + dr)
    k, v = torch.cat([c_kv, k_rope], -1)[:, None], c_kv[:, None]  # one KV head: (B, 1, S, r + dr), (B, 1, S, r)
    ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                           scale=(q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5)
    return torch.einsum("bhr,hdr->bhd", ctx[:, :, 0], w_uv)


def _shortcut_grouped(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):  # the course's grouped attention, one KV head
    from attncourse.mha import grouped_attention
    q = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_rope], -1)[:, :, None]  # (B, H, 1, r + dr)
    k, v = torch.cat([c_kv, k_rope], -1)[:, None], c_kv[:, None]  # one KV head: (B, 1, S, r + dr), (B, 1, S, r)
    ctx = grouped_attention(q, k, v, scale=(q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5)
    return torch.einsum("bhr,hdr->bhd", ctx[:, :, 0], w_uv)


def _shortcut_course_sdpa(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):  # K/V expanded, then the course's attention
    from attncourse.sdpa import scaled_dot_product_attention
    b, h, dn = q_nope.shape
    s = c_kv.shape[1]
    k = torch.cat([torch.einsum("bsr,hdr->bhsd", c_kv, w_uk), k_rope[:, None].expand(b, h, s, -1)], -1)
    v = torch.einsum("bsr,hdr->bhsd", c_kv, w_uv)
    q = torch.cat([q_nope, q_rope], -1)[:, :, None]
    return scaled_dot_product_attention(q, k, v)[:, :, 0]


def _shortcut_module(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):  # the course's module, absorbed, weights copied in
    from attncourse.mla import MLACache, MultiHeadLatentAttention
    from attncourse.positions import apply_rope
    b, h, dn = q_nope.shape
    dr, (s, r) = q_rope.shape[-1], c_kv.shape[1:]
    d = h * (dn + dr) + r + dr  # x = [queries, new latent, new RoPE key], picked out by identity projections
    mla = MultiHeadLatentAttention(d, h, kv_rank=r, head_dim=dn, rope_dim=dr).to(q_nope.dtype)
    eye = torch.eye(d, dtype=q_nope.dtype)
    back = torch.tensor([-(s - 1)])  # the module rotates the new token at position S - 1: hand it unrotated
    with torch.no_grad():
        mla.q_proj.weight.copy_(eye[:h * (dn + dr)])
        mla.kv_down.weight.copy_(eye[h * (dn + dr):h * (dn + dr) + r])
        mla.k_rope_proj.weight.copy_(eye[h * (dn + dr) + r:])
        mla.k_up.weight.copy_(w_uk.reshape(h * dn, r))
        mla.v_up.weight.copy_(w_uv.reshape(h * dn, r))
        mla.o_proj.weight.copy_(eye[:, :h * dn])
        q = torch.cat([q_nope, apply_rope(q_rope[:, :, None], back, inv_freq=mla.inv_freq)[:, :, 0]], -1)
        x = torch.cat([q.reshape(b, 1, -1), c_kv[:, -1:], apply_rope(k_rope[:, -1:], back, inv_freq=mla.inv_freq)], -1)
        cache = MLACache()
        if s > 1:
            cache.c_kv, cache.k_rope = c_kv[:, :-1], k_rope[:, :-1]
        out = mla(x, kv_cache=cache, absorbed=True)  # (B, 1, d)
    return out[:, 0, :h * dn].view(b, h, dn)


# ----------------------------------------------------------------------------- right outputs computed the wrong way


def _breaker_expanded(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """The naive form: every cached latent expanded into per-head keys and values, then attention."""
    b, h, dn = q_nope.shape
    s, r = c_kv.shape[1:]
    k = (c_kv @ w_uk.reshape(h * dn, r).T).view(b, s, h, dn).transpose(1, 2)  # (B, H, S, dn)
    v = (c_kv @ w_uv.reshape(h * dn, r).T).view(b, s, h, dn).transpose(1, 2)
    scores = (q_nope[:, :, None] @ k.transpose(-2, -1))[:, :, 0] + q_rope @ k_rope.transpose(1, 2)  # (B, H, S)
    return (torch.softmax(scores / math.sqrt(dn + q_rope.shape[-1]), -1)[:, :, None] @ v)[:, :, 0]


def _breaker_values_expanded(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """W_UK absorbed, but the values expanded per head from the cache before the weighted sum."""
    b, h, dn = q_nope.shape
    s, r = c_kv.shape[1:]
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    scores = q_lat @ c_kv.mT + q_rope @ k_rope.transpose(1, 2)  # (B, H, S)
    w = torch.softmax(scores / math.sqrt(dn + q_rope.shape[-1]), -1)
    v = (c_kv @ w_uv.reshape(h * dn, r).T).view(b, s, h, dn).transpose(1, 2)  # (B, H, S, dn)
    return (w[:, :, None] @ v)[:, :, 0]


def _breaker_broadcast(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """Absorbed, with (B, H, 1, .) @ (B, 1, ., S): the matmul broadcasts the cache over the heads (a copy at B > 1)."""
    dn, dr = q_nope.size(-1), q_rope.size(-1)
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)[:, :, None]  # (B, H, 1, r)
    scores = q_lat @ c_kv[:, None].transpose(-2, -1) + q_rope[:, :, None] @ k_rope[:, None].transpose(-2, -1)
    ctx = (torch.softmax(scores / math.sqrt(dn + dr), -1) @ c_kv[:, None])[:, :, 0]  # (B, H, r)
    return torch.einsum("bhr,hdr->bhd", ctx, w_uv)


def _breaker_head_loop(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """Absorbed, one head at a time: no copy, but the cache is read once per head."""
    dn, dr = q_nope.size(-1), q_rope.size(-1)
    outs = []
    for hh in range(q_nope.shape[1]):
        q_lat = q_nope[:, hh] @ w_uk[hh]  # (B, r)
        scores = (q_lat[:, None] @ c_kv.transpose(1, 2) + q_rope[:, hh, None] @ k_rope.transpose(1, 2))[:, 0]
        ctx = (torch.softmax(scores / math.sqrt(dn + dr), -1)[:, None] @ c_kv)[:, 0]  # (B, r)
        outs.append(ctx @ w_uv[hh].T)
    return torch.stack(outs, 1)


def _breaker_rope_per_head(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """The latent read once with the heads folded, but the RoPE key copied for every head."""
    b, h, dn = q_nope.shape
    dr, s = q_rope.shape[-1], c_kv.shape[1]
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    k_rep = k_rope[:, None].expand(b, h, s, dr).contiguous()  # (B, H, S, dr)
    scores = q_lat @ c_kv.mT + (q_rope[:, :, None] @ k_rep.transpose(-2, -1))[:, :, 0]
    return torch.einsum("bhr,hdr->bhd", torch.softmax(scores / math.sqrt(dn + dr), -1) @ c_kv, w_uv)


def _breaker_products(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """No matmul over the cache: products broadcast over (B, H, S, r), then summed."""
    dn, dr = q_nope.size(-1), q_rope.size(-1)
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    scores = (q_lat[:, :, None] * c_kv[:, None]).sum(-1) + (q_rope[:, :, None] * k_rope[:, None]).sum(-1)
    ctx = (torch.softmax(scores / math.sqrt(dn + dr), -1)[..., None] * c_kv[:, None]).sum(2)  # (B, H, r)
    return torch.einsum("bhr,hdr->bhd", ctx, w_uv)


@exercise("05-mla-absorbed-decode", "mla_absorbed_decode", points=3, category="implement",
          forbid=("torch.nn.functional.scaled_dot_product_attention",), allow=(), ops=("attention",),
          shortcuts=(_shortcut_sdpa_mqa, _shortcut_grouped, _shortcut_course_sdpa, _shortcut_module),
          prop=_cache_read_once,
          prop_doc="the cache is read as MQA reads its one KV head: W_UK goes into the queries and W_UV after the "
                   "weighted sum (the matmuls do the absorbed step's work, not the expansion of S latents per head), "
                   "and no tensor of the latent or RoPE key copied, expanded or broadcast per head is built or handed "
                   "to an operator, nor read once per head by a loop, seen in the trace",
          breakers=(_breaker_expanded, _breaker_values_expanded, _breaker_broadcast, _breaker_head_loop,
                    _breaker_rope_per_head, _breaker_products),
          hint="write each head's score against cached position s with the key expanded, then move the head's "
               "up-projection to the other side of the dot product; which tensors then differ from head to head, "
               "and which are the same for all of them? The heads can then share one matmul, like the query heads "
               "of one GQA group")
def _mla_absorbed_decode():
    """One decode step of MLA from its latent cache with W_UK and W_UV absorbed, equal to the expanded module."""
    gen = torch.Generator().manual_seed(58)
    cases = []
    for name, (b, h, r, dr, dn, s) in MLA_DECODE_CASES.items():
        mla = _module(gen, h, r, dr, dn)
        x = torch.randn(b, s, h * dn, generator=gen, dtype=torch.float64)
        args, expected = decode_step_reference(mla, x)
        cases.append(Case(name, args, expected=expected, rtol=1e-5, atol=1e-7))  # the module mixes in float32
    return cases
