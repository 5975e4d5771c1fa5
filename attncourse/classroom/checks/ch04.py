"""Checks for chapter 04, multi-head attention and the Transformer block (solutions/04_multi_head_attention.ipynb)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attncourse.mha import MultiHeadAttention
from attncourse.transformer import TransformerBlock
from . import Case, edits, exercise, rules

_FORBID = ("torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward",
           "torch.nn.MultiheadAttention", "attncourse.scaled_dot_product_attention",
           "attncourse.sdpa.scaled_dot_product_attention")


def _weights(gen: torch.Generator, d: int) -> tuple[torch.Tensor, ...]:
    """Four (d, d) matrices in nn.Linear's (out, in) layout."""
    return tuple(torch.randn(d, d, generator=gen, dtype=torch.float64) / d ** 0.5 for _ in range(4))


def reference_mha(x, context, w_q, w_k, w_v, w_o, n_heads, **kw):
    """The package's MultiHeadAttention holding the given (out, in) projection matrices, no bias."""
    m = MultiHeadAttention(x.shape[-1], n_heads).to(x.dtype)
    with torch.no_grad():
        for proj, w in zip((m.q_proj, m.k_proj, m.v_proj, m.o_proj), (w_q, w_k, w_v, w_o)):
            proj.weight.copy_(w)
        return m(x, context, **kw)


# ----------------------------------------------------------------------------- 1. per-head weights


def per_head_to_linear(w_q, w_k, w_v, w_o):
    """Per-head (H, d, D) input matrices and (H, D, d) output matrices -> four (out, in) nn.Linear weights."""
    h, d, dh = w_q.shape
    w_in = [w.transpose(1, 2).reshape(h * dh, d) for w in (w_q, w_k, w_v)]  # row h*D + i is head h's column i
    return (*w_in, w_o.reshape(h * dh, d).T)  # concat(heads) @ W_o: W_o's rows h*D .. h*D+D-1 are head h's


def _per_head_by_module(x, context, w_q, w_k, w_v, w_o):
    return reference_mha(x, context, *per_head_to_linear(w_q, w_k, w_v, w_o), w_q.shape[0])


def _per_head_qkv(x, context, w_q, w_k, w_v):
    q = torch.einsum("btd,hde->bhte", x, w_q)  # (B, H, T, D)
    k, v = (torch.einsum("bsd,hde->bhse", context, w) for w in (w_k, w_v))  # (B, H, S, D)
    return q, k, v


def _per_head_by_fused(x, context, w_q, w_k, w_v, w_o):
    heads = F.scaled_dot_product_attention(*_per_head_qkv(x, context, w_q, w_k, w_v))  # (B, H, T, D)
    return torch.einsum("bhte,hed->btd", heads, w_o)


def _per_head_by_aten_flash(x, context, w_q, w_k, w_v, w_o):  # the same kernel under its ATen name
    heads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_per_head_qkv(x, context, w_q, w_k, w_v))[0]
    return torch.einsum("bhte,hed->btd", heads, w_o)


def _per_head_by_aten_math(x, context, w_q, w_k, w_v, w_o):  # PyTorch's reference attention, by its ATen name
    heads = torch.ops.aten._scaled_dot_product_attention_math(*_per_head_qkv(x, context, w_q, w_k, w_v))[0]
    return torch.einsum("bhte,hed->btd", heads, w_o)


def _per_head_by_torch_module(x, context, w_q, w_k, w_v, w_o):  # nn.MultiheadAttention with the weights stacked
    h, d, dh = w_q.shape
    m = nn.MultiheadAttention(d, h, bias=False, batch_first=True).to(x.dtype)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([w.transpose(1, 2).reshape(h * dh, d) for w in (w_q, w_k, w_v)]))
        m.out_proj.weight.copy_(w_o.reshape(h * dh, d).T)
        return m(x, context, context, need_weights=False)[0]


@exercise("04-mha-per-head", "mha_per_head", points=3, category="implement", forbid=_FORBID,
          allow=(), ops=("attention",),
          shortcuts=(_per_head_by_module, _per_head_by_fused, _per_head_by_aten_flash, _per_head_by_aten_math,
                     _per_head_by_torch_module),
          prop_doc="output equality is the property: with every fused attention kernel and the course's attention "
                   "refused, the only way to the output (self and cross, 1 to 8 heads) is to run each head's "
                   "attention from its own matrices and sum what each head meets of W_O",
          hint="each head's queries, keys and values come from the input and that head's matrices alone; w_o is "
               "given per head too: work out what each head's output contributes to the result")
def _mha_per_head():
    """Multi-head attention from per-head projection matrices (the paper's W_i^Q, W_i^K, W_i^V and W^O's slices)."""
    gen = torch.Generator().manual_seed(40)
    cases = []
    for name, (b, t, s, d, h) in {"self-attention (2, 5, 16), 4 heads": (2, 5, 5, 16, 4),
                                  "cross-attention: 7 queries over 3 keys, 3 heads": (1, 7, 3, 12, 3),
                                  "8 heads of width 1": (3, 2, 4, 8, 8), "one head": (2, 6, 6, 8, 1)}.items():
        x = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
        context = x if s == t else torch.randn(b, s, d, generator=gen, dtype=torch.float64)
        dh = d // h
        w_q, w_k, w_v = (torch.randn(h, d, dh, generator=gen, dtype=torch.float64) / d ** 0.5 for _ in range(3))
        w_o = torch.randn(h, dh, d, generator=gen, dtype=torch.float64) / d ** 0.5
        args = (x, context, w_q, w_k, w_v, w_o)
        cases.append(Case(name, args, expected=_per_head_by_module(*args), rtol=1e-7, atol=1e-9))
    return cases


# ----------------------------------------------------------------------------- 2. find the bug


def _fixed_by_module(x, w_q, w_k, w_v, w_o, n_heads):  # the course's module with the weights copied in
    return reference_mha(x, None, w_q, w_k, w_v, w_o, n_heads)


def _fixed_by_course_class(x, w_q, w_k, w_v, w_o, n_heads):
    m = MultiHeadAttention(x.shape[-1], n_heads).to(x.dtype)
    with torch.no_grad():
        for proj, w in zip((m.q_proj, m.k_proj, m.v_proj, m.o_proj), (w_q, w_k, w_v, w_o)):
            proj.weight.copy_(w)
        return m(x)


def _fixed_by_aten_math(x, w_q, w_k, w_v, w_o, n_heads):  # the reference attention under its ATen name
    q, k, v = [(x @ w.mT).unflatten(-1, (n_heads, -1)).transpose(1, 2) for w in (w_q, w_k, w_v)]
    heads = torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]
    return heads.transpose(1, 2).flatten(2) @ w_o.T


def _fixed_by_torch_module(x, w_q, w_k, w_v, w_o, n_heads):
    m = nn.MultiheadAttention(x.shape[-1], n_heads, bias=False, batch_first=True).to(x.dtype)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([w_q, w_k, w_v]))
        m.out_proj.weight.copy_(w_o)
        return m(x, x, x, need_weights=False)[0]


# The given function exactly as the exercise notebook shows it (tests/test_edits.py compares the two).
BUGGY_MHA = '''\
def mha_buggy(x, w_q, w_k, w_v, w_o, n_heads):
    B, T, d = x.shape
    D = d // n_heads
    q, k, v = ((x @ w.T).transpose(0, 1).reshape(T, B * n_heads, D).transpose(0, 1)   # heads in the batch axis,
               for w in (w_q, w_k, w_v))                                               # (B*H, T, D) each
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1)            # (B*H, T, T)
    return (weights @ v).reshape(B, T, d) @ w_o.T                                      # (B, T, d)
'''
FIX_MHA = edits.SmallEdit(BUGGY_MHA, most=30, lines=(7,),  # the fix's spellings: 11-20 tokens; the lesson's pasted: 50+
                          names=("view", "unflatten", "flatten", "permute", "swapaxes", "swapdims", "movedim",
                                 "contiguous", "mT", "unbind", "cat"))


def _breaker_rewrite_mha(x, w_q, w_k, w_v, w_o, n_heads):
    """Multi-head attention written from the paper's formula without reading the given code: right values,
    refused as no edit of the given function."""
    b, t, d = x.shape
    heads = [(x @ w.T).view(b, t, n_heads, d // n_heads).permute(0, 2, 1, 3) for w in (w_q, w_k, w_v)]
    q, k, v = heads  # (B, H, T, D) each
    weights = (q @ k.mT * (d // n_heads) ** -0.5).softmax(-1)  # (B, H, T, T)
    return (weights @ v).permute(0, 2, 1, 3).reshape(b, t, d) @ w_o.T


@exercise("04-find-the-bug-1", "mha_fixed", points=2, category="bug", forbid=_FORBID, aliases=("04-head-scale-bug",),
          allow=(), ops=("attention",),
          shortcuts=(_fixed_by_module, _fixed_by_course_class, _fixed_by_aten_math, _fixed_by_torch_module),
          prop=edits.prop(FIX_MHA, "`mha_fixed`"), trace=False, breakers=(_breaker_rewrite_mha,),
          prop_doc="the diagnosis: the right output for 1 to 8 heads, from the given function with a small edit "
                   "where it is wrong (a layer written afresh, or the course's module with the weights copied in, "
                   "does not show the bug was found)",
          bug_words=("without transpos", "missing transpos", "no transpose", "forgets to transpose",
                     "transpose is missing", "mixes tokens", "mixes positions", "heads and tokens",
                     "token axis", "interleaves", "reshape instead", "view instead", "wrong merge", "merge wrong",
                     "merged wrong", "merge is wrong", "undo the split", "undoes the split", "inverse of the split",
                     "memory order", "row-major"),
          hint="it agrees with nn.MultiheadAttention for one head and not for several: take batch 1 with 2 heads, "
               "and print which of the attention's output numbers end up in token 0's row before w_o, and which "
               "should")
def _scale_bug():
    """Find and fix the bug in a colleague's multi-head attention."""
    gen = torch.Generator().manual_seed(41)
    cases = []
    for name, (b, t, d, h) in {"(2, 5, 16) with 4 heads": (2, 5, 16, 4), "(1, 7, 12) with 3 heads": (1, 7, 12, 3),
                               "one head": (2, 6, 8, 1), "8 heads of width 2": (1, 9, 16, 8)}.items():
        x = torch.randn(b, t, d, generator=gen, dtype=torch.float64) * 2
        w = _weights(gen, d)
        cases.append(Case(name, (x, *w, h), expected=reference_mha(x, None, *w, h), rtol=1e-7, atol=1e-9))
    return cases


# ----------------------------------------------------------------------------- 3. predict


def _rows_that_survive(perm: list[int]) -> tuple[bool, ...]:
    """Which rows of mha(x[:, perm], is_causal=True) equal rows of mha(x, is_causal=True)[:, perm], measured."""
    gen = torch.Generator().manual_seed(43)
    m = MultiHeadAttention(8, 2).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))  # scores of order 1: no key
        x = torch.randn(1, len(perm), 8, generator=gen, dtype=torch.float64)       # drowns in the softmax
        y, out = m(x[:, perm], is_causal=True), m(x, is_causal=True)[:, perm]
    return tuple(bool(torch.allclose(y[0, i], out[0, i], rtol=0, atol=1e-10)) for i in range(len(perm)))


PERMUTATIONS = ([1, 0, 2, 4, 3], [2, 0, 1, 3, 4])


def _block_permutation(n: int, gen: torch.Generator) -> list[int]:
    """A permutation of 0..n-1 that shuffles within random blocks (and sometimes swaps two far tokens), so that
    some rows survive and some do not."""
    cuts = sorted(set(torch.randint(1, n, (n // 3,), generator=gen).tolist()))
    perm, start = [], 0
    for end in [*cuts, n]:
        perm += [start + int(i) for i in torch.randperm(end - start, generator=gen)]
        start = end
    if torch.rand((), generator=gen) < 0.5:  # a swap across blocks: every row between the two changes its prefix
        i, j = sorted(torch.randperm(n, generator=gen)[:2].tolist())
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def _rows_rule(got, expected) -> str | None:
    """Right or not, nothing more: yes/no parts told "k wrong" give the answer in a few tries."""
    n = len(expected)
    if not (isinstance(got, (tuple, list)) and len(got) == n and all(isinstance(b, bool) for b in got)):
        return f"expected a tuple of {n} bools (one per row), got {str(got)[:120]}"
    if tuple(got) != tuple(expected):
        return "your rule is not right for this permutation; for each row, write down the tokens it sees before " \
               "and after the permutation"
    return None


@exercise("04-predict-causal-permutation", "rows_that_survive", points=1, category="predict", allow=(),
          ops=("torch",), prop=rules.prop("`rows_that_survive`"),
          prop_doc="output equality is the property, on permutations the grader draws (10 to 16 tokens): the rule "
                   "is judged on every row of every permutation, and it must be a rule over indices: one def that "
                   "compares, counts and takes sets, with no name from outside but a few built-ins, no float, no "
                   "import and no arithmetic but + and - (checks/rules.py). A measurement (the module, NumPy, or an "
                   "attention simulated in plain Python with math.exp or **) is refused, so is a table of the check "
                   "cell's permutations",
          hint="work one small permutation through by hand, say 4 tokens with two of them swapped: for each output "
               "row, what does its query read before the permutation, and what after?")
def _predict_permutation():
    """Predict, as a rule, which rows survive permuting the tokens of a causal self-attention without positions."""
    gen = torch.Generator().manual_seed(44)
    perms = [*PERMUTATIONS, *(_block_permutation(int(n), gen) for n in torch.randint(10, 17, (6,), generator=gen))]
    return [Case(f"permutation {k + 1} of {len(perms)} ({len(p)} tokens)", (list(p),),
                 expected=_rows_that_survive(p), compare=_rows_rule) for k, p in enumerate(perms)]


# ----------------------------------------------------------------------------- 4. experiment: where parameters sit


def reference_shares(d_model: int, n_heads: int, d_ff: int, vocab_size: int, n_layers: int,
                     options: dict | None = None) -> dict[str, float]:
    """The reference: shares of an embedding + n_layers TransformerBlocks' parameters (built with the keyword
    arguments `options`), by kind of module."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        embedding = nn.Embedding(vocab_size, d_model)
        blocks = [TransformerBlock(d_model, n_heads, d_ff, **(options or {})) for _ in range(n_layers)]
    counts = {"embedding": embedding.weight.numel(), "attention": 0, "feed_forward": 0, "layer_norm": 0}
    for block in blocks:
        counts["attention"] += sum(p.numel() for p in block.attn.parameters())
        counts["feed_forward"] += sum(p.numel() for p in block.ff.parameters())
        counts["layer_norm"] += sum(p.numel() for n in (block.norm1, block.norm2) for p in n.parameters())
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


def _shares_rule(got, expected) -> str | None:
    if not isinstance(got, dict) or set(map(str, got)) != set(expected):
        return f"expected a dict with keys {sorted(expected)}, got {str(got)[:200]}"
    for key, value in expected.items():
        mine = got[key]
        if isinstance(mine, bool) or not isinstance(mine, (int, float)):
            return f"{key!r} should be a float (a share of all parameters), got {mine!r}"
        if abs(mine - value) > 1e-6:  # how far off, never the share itself
            return (f"{key!r}: your share is off by {abs(mine - value):.2g}: count every parameter of the blocks "
                    "as built with the case's options, biases too")
    return None


def _built_blocks(runs) -> str | None:
    """The experiment's property: on every case the answer built the course's blocks, n_layers of them at the
    case's width (each block initialises its (d, d) query and output projections inside TransformerBlock)."""
    for run in runs:
        d_model, n_layers = run.case.args[0], run.case.args[4]
        square = sum(1 for _, _, in_allowed, tensors in (run.trace or {}).get("ops", ())
                     if in_allowed and any(t[2] == (d_model, d_model) for t in tensors))
        if square < 2 * n_layers:
            return (f"on case '{run.case.name}' your code did not build the {n_layers} TransformerBlock(s) it "
                    "counts: this experiment measures the course's modules as built (under torch.device('meta')), "
                    "not a formula for them")
    return None


def _closed_form_shares(d_model, n_heads, d_ff, vocab_size, n_layers, options=None):
    """The right shares from a formula (every option of the cases handled), no module built: refused by the
    property. A formula that ignores the options is refused by the values (tests/test_ch04_checks.py)."""
    options = options or {}
    b = int(options.get("bias", True))
    kv = d_model // n_heads * options.get("n_kv_heads", n_heads)
    counts = {"embedding": vocab_size * d_model,
              "attention": n_layers * (2 * d_model * d_model + 2 * d_model * kv + b * (2 * d_model + 2 * kv)),
              "feed_forward": n_layers * (2 * d_model * d_ff + b * (d_ff + d_model)),
              "layer_norm": n_layers * (2 + 2 * b) * d_model}
    return {k: v / sum(counts.values()) for k, v in counts.items()}


@exercise("04-parameter-shares", "parameter_shares", points=2, category="experiment",
          allow=("attncourse.transformer.TransformerBlock",), trace=True, prop=_built_blocks,
          breakers=(_closed_form_shares,),
          forbid=("torch.nn.TransformerEncoderLayer", "torch.nn.TransformerDecoderLayer", "torch.nn.Transformer",
                  "torch.nn.TransformerEncoder", "torch.nn.TransformerDecoder"),
          hint="build the modules (the course's TransformerBlock with the case's options, and an embedding table) "
               "at each size and count the elements of the parameters of each kind of submodule; divide by the total")
def _parameter_shares():
    """Measure which parts of a Transformer hold its parameters, from a small model to a GPT-2-sized block.

    Every case but the first builds its blocks with options drawn here (a salted grader draws others): no biases
    (as in LLaMA-style blocks), fewer key/value heads (GQA), or both, so an answer that builds the blocks and then
    returns a formula for the default block gets the shares wrong."""
    configs = [(64, 4, 256, 1000, 2), (256, 8, 1024, 32_000, 4), (768, 12, 3072, 50_257, 1), (32, 2, 32, 10, 3)]
    gen = torch.Generator().manual_seed(45)  # two more models, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    for _ in range(2):
        n_heads = pick(1, 16)
        d_model = n_heads * 8 * pick(1, 16)
        configs.append((d_model, n_heads, d_model * pick(1, 4), pick(10, 60_000), pick(1, 12)))
    cases = []
    for k, args in enumerate(configs):
        fewer = [h for h in range(1, args[1]) if args[1] % h == 0]  # key/value head counts below n_heads
        options = [{}, {"bias": False}, {"n_kv_heads": 0}, {"bias": False, "n_kv_heads": 0}][k % 4 if fewer else k % 2]
        if "n_kv_heads" in options:
            options["n_kv_heads"] = fewer[int(torch.randint(len(fewer), (1,), generator=gen))]
        name = "d_model={}, heads={}, d_ff={}, vocab={}, layers={}".format(*args)
        name += "".join(f", {key}={value}" for key, value in options.items())
        cases.append(Case(name, args, {"options": options} if options else {},
                          expected=reference_shares(*args, options), compare=_shares_rule))
    return cases
