"""Checks for chapter 10, FlashAttention in Triton (solutions/10_flash_attention_triton.ipynb).

The learner writes Triton: the check cell and the grader call the learner's Python launcher, which runs the
learner's ``@triton.jit`` kernel (under ``TRITON_INTERPRET=1`` on a CPU, set by the notebook's first cell).
Expected values are computed here in plain PyTorch from their definitions (the course's oracle and masks), never
by a copy of the solution. This module imports no Triton when it loads (every notebook's `check` and the grader
load all chapters); the two exercises whose reference is the package's own decode kernel import it lazily.
"""

from __future__ import annotations

import math
import re

import torch

from attncourse.mha import repeat_kv
from attncourse.sdpa import safe_softmax, scaled_dot_product_attention
from . import Case, edits, exercise, forbidden
from .ch10_given import FIX_DECODE

_NEG_INF = float("-inf")


def _triton_decode():
    """attncourse.triton_decode, with the interpreter switched on first where there is no GPU."""
    from attncourse import triton_common

    if not torch.cuda.is_available():
        triton_common.enable_interpreter()
    from attncourse import triton_decode

    return triton_decode


# ----------------------------------------------------------------------------- the property of a Triton exercise

# What a launcher may run outside its kernel: allocate, view, convert (never compute values, nor write them from
# Python: a tensor built from Python numbers, a fill, an indexed write or a gather all count as computing).
_HOST_OPS = re.compile(r"^(view|_unsafe_view|reshape|expand|permute|transpose|t|slice|select|unsqueeze|squeeze|alias|"
                       r"detach|clone|contiguous|_to_copy|empty|empty_like|empty_strided|zeros|zeros_like|new_empty|"
                       r"new_zeros|_local_scalar_dense|as_strided|is_nonzero|item|split|unbind|chunk|narrow|"
                       r"sym_size|sym_stride|sym_numel|sym_storage_offset)$")


def _base(op: str) -> str:
    return op.split("::")[-1].split(".")[0]


def in_kernel(runs) -> str | None:
    """The property of a Triton exercise: a @triton.jit kernel was launched on every case, and no PyTorch operation
    computed (or wrote) values outside it: the launcher only allocates, views, converts and launches."""
    for run in runs:
        trace = run.trace or {}
        if not trace.get("launches"):
            return (f"no Triton kernel ran on case '{run.case.name}': this exercise asks for the work to happen in "
                    "the @triton.jit kernel your launcher calls")
        for op, in_launch, in_allowed, _ in trace.get("ops", ()):
            if in_allowed:
                continue
            name = _base(op)
            if (forbidden.DATA_OPS.match(name) if in_launch else _HOST_OPS.match(name)) is None:
                return (f"your code ran the PyTorch operation {name} {'inside the kernel' if in_launch else 'outside the kernel'} "
                        f"on case '{run.case.name}': the kernel must compute the result, the launcher only allocates, "
                        "converts and launches")
    return None


# ----------------------------------------------------------------------------- 1. the online update, lse form


def _attention_state(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention with these scores (R, C) over these values (C, D), in float64: the definition."""
    scores, values = scores.double(), values.double()
    out = safe_softmax(scores) @ values  # (R, C) @ (C, D) -> (R, D); zeros on rows with no finite score
    return out, torch.logsumexp(scores, dim=-1)  # -inf on those rows


def _shortcut_online_update(out, lse, s, v):
    """Chapter 08's library update on the state (m, l, acc) = (lse, 1, out): must be refused."""
    from attncourse.online_softmax import AttentionState, finalize_attention_state, online_attention_update

    state = AttentionState(lse, (lse > _NEG_INF).to(out.dtype), out)  # l = 1 where a key was seen
    return finalize_attention_state(online_attention_update(state, s, v))


def _breaker_online_update(out, lse, s, v):
    """The update in plain PyTorch (exp2 with a change of base, no kernel): the right numbers, no Triton."""
    log2e = 1.4426950408889634
    ref = torch.maximum(lse, s.amax(-1))
    ref = torch.where(torch.isinf(ref), torch.zeros_like(ref), ref)
    w_old = torch.exp2((lse - ref) * log2e)  # (R,)
    p = torch.exp2((s - ref[:, None]) * log2e)  # (R, C)
    total = w_old + p.sum(-1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out_new = (w_old[:, None] * out + p @ v) / safe[:, None]  # (R, D)
    return out_new, torch.where(total > 0, ref + torch.log(safe), torch.full_like(ref, float("-inf")))


@exercise("10-online-update", "lse_update", points=3, category="implement",
          forbid=("torch.exp", "torch.logsumexp", "torch.logaddexp", "torch.softmax", "torch.nn.functional.softmax",
                  "attncourse.sdpa.safe_softmax", "attncourse.online_softmax.online_attention_update",
                  "attncourse.online_softmax.merge_attention_states",
                  "attncourse.online_softmax.finalize_attention_state"),
          allow=(), ops=("softmax", "logsumexp"), prop=in_kernel,
          prop_doc="the update runs in a Triton kernel: a launch on every case, no PyTorch arithmetic outside it",
          breakers=(_breaker_online_update,),
          shortcuts=(_shortcut_online_update,), gradient=False,  # a Triton kernel's result has no autograd graph
          hint="the old state and the new block are log-sum-exps over two disjoint sets of keys: bring both to one "
               "reference (the larger) before adding them, and weight the old output by its share. A row whose "
               "reference is -inf has seen no key anywhere and must stay (0, -inf): never compute -inf - (-inf)")
def _online_update_cases():
    """In Triton: fold a block of scores into a normalised (out, lse) state."""
    gen = torch.Generator().manual_seed(10)
    cases = []
    for name, (rows, seen, new, d, edit) in {
        "first block: nothing seen yet (lse = -inf)": (5, 0, 7, 3, None),
        "second block with larger scores": (6, 9, 5, 4, "larger"),
        "rows whose new scores are all -inf (masked)": (6, 9, 5, 4, "masked"),
        "a row that has seen no key and sees none now": (6, 4, 5, 4, "empty"),
        "20 rows (two programs), 33 keys, head dim 5": (20, 11, 33, 5, None),
        "large scores (x 50): no overflow": (4, 6, 6, 3, "large"),
    }.items():
        s0 = torch.randn(rows, seen, generator=gen)  # (R, C0) scores already folded into the state
        s1 = torch.randn(rows, new, generator=gen)  # (R, C1) this block's scores
        v0, v1 = torch.randn(seen, d, generator=gen), torch.randn(new, d, generator=gen)
        if edit == "larger":
            s1 = s1 + 3.0  # the max moves up: the old output must be down-weighted
        elif edit in ("masked", "empty"):
            s1[1] = _NEG_INF
            s1[2, ::2] = _NEG_INF
            if edit == "empty":
                s0[1] = _NEG_INF  # row 1: nothing before, nothing now
        elif edit == "large":
            s0, s1 = s0 * 50, s1 * 50
        out0, lse0 = _attention_state(s0, v0) if seen else (torch.zeros(rows, d, dtype=torch.float64),
                                                           torch.full((rows,), _NEG_INF, dtype=torch.float64))
        expected = _attention_state(torch.cat([s0, s1], 1), torch.cat([v0, v1]))  # attention over all keys seen
        cases.append(Case(name, (out0.float(), lse0.float(), s1, v1), expected=tuple(e.float() for e in expected),
                          rtol=1e-5, atol=1e-5))
    return cases


# ----------------------------------------------------------------------------- 2. the backward's query range


def _allowed(t_q: int, t_k: int, causal_align: str, window: int | None) -> torch.Tensor:
    """(Tq, Tk) causal mask, aligned and windowed: query i at position p = i + offset sees p - W < j <= p."""
    offset = t_k - t_q if causal_align == "bottom_right" else 0
    pos = torch.arange(t_q)[:, None] + offset  # (Tq, 1)
    j = torch.arange(t_k)[None, :]  # (1, Tk)
    keep = j <= pos
    return keep & (j > pos - window) if window is not None else keep


def _query_blocks_needed(t_q, t_k, block_q, block_k, causal_align, window) -> torch.Tensor:
    """(key blocks, query blocks): True where the tile holds at least one allowed (query, key) pair."""
    n_qb, n_kb = math.ceil(t_q / block_q), math.ceil(t_k / block_k)
    padded = torch.zeros(n_qb * block_q, n_kb * block_k, dtype=torch.bool)
    padded[:t_q, :t_k] = _allowed(t_q, t_k, causal_align, window)
    return padded.reshape(n_qb, block_q, n_kb, block_k).any(3).any(1).T.contiguous()  # (KB, QB)


def _shortcut_query_blocks(t_q, t_k, block_q, block_k, causal_align, window):
    """Materialise the mask with the course's causal mask (a window on top) and reduce it per tile: must be refused."""
    from attncourse.sdpa import causal_mask

    offset = t_k - t_q if causal_align == "bottom_right" else 0
    rows = torch.arange(t_q)[:, None] + offset  # (Tq, 1) aligned positions
    keep = causal_mask(t_q + max(offset, 0), t_k)[max(offset, 0):] if offset >= 0 else \
        causal_mask(t_q, t_k + t_q)[:, -offset:-offset + t_k] & (rows >= 0)
    if window is not None:
        keep = keep & (torch.arange(t_k)[None, :] > rows - window)
    n_qb, n_kb = -(-t_q // block_q), -(-t_k // block_k)
    padded = torch.zeros(n_qb * block_q, n_kb * block_k, dtype=torch.bool)
    padded[:t_q, :t_k] = keep
    return padded.reshape(n_qb, block_q, n_kb, block_k).any(3).any(1).T


def _breaker_query_blocks(t_q, t_k, block_q, block_k, causal_align, window):
    """The right ranges computed in Python and written into the table from Python: no kernel."""
    offset = t_k - t_q if causal_align == "bottom_right" else 0
    n_qb, n_kb = -(-t_q // block_q), -(-t_k // block_k)
    visit = torch.zeros(n_kb, n_qb, dtype=torch.bool)
    for kb in range(n_kb):
        lo = max(kb * block_k - offset, 0) // block_q * block_q
        hi = t_q if window is None else max(min(t_q, min(kb * block_k + block_k, t_k) - 1 + window - offset), 0)
        for qb in range(n_qb):
            visit[kb, qb] = lo <= qb * block_q < hi
    return visit


@exercise("10-causal-blocks", "query_blocks", points=2, category="implement",
          forbid=("attncourse.masks.materialize", "attncourse.masks.materialize_at", "attncourse.sdpa.causal_mask",
                  "attncourse.flash.causal_tile_map", "torch.tril", "torch.triu"),
          allow=(), ops=("aten::tril", "aten::triu"), prop=in_kernel,
          prop_doc="the table is computed in a Triton kernel: a launch on every case, no values computed or written "
                   "outside it",
          breakers=(_breaker_query_blocks,),
          shortcuts=(_shortcut_query_blocks,),
          hint="ask two questions about a query at aligned position p: from which p on does it see the block's "
               "first key, and up to which p does its window still reach the block's last key? Turn both positions "
               "into row indices, keep them inside [0, Tq] (clamp before dividing: negative integer division "
               "rounds differently on a GPU and in NumPy), and start the loop on a query-block boundary")
def _causal_blocks_cases():
    """In Triton: which query blocks the backward's dK/dV program for each key block must visit."""
    table = {
        "causal, top-left, T = 100, blocks 32 x 16": (100, 100, 32, 16, "top_left", None),
        "bottom-right, Tq = 40 < Tk = 100": (40, 100, 16, 32, "bottom_right", None),
        "bottom-right, Tq = 100 > Tk = 40 (early rows see nothing)": (100, 40, 16, 16, "bottom_right", None),
        "window 1 (each query sees itself)": (64, 64, 16, 16, "top_left", 1),
        "window 20 across tiles, T = 100": (100, 100, 16, 32, "top_left", 20),
        "window 33, bottom-right, Tq = 48, Tk = 100": (48, 100, 16, 16, "bottom_right", 33),
        "window larger than the keys": (30, 30, 16, 16, "top_left", 1000),
        "top-left, Tq = 70 > Tk = 20, window 5 (late rows see nothing)": (70, 20, 16, 16, "top_left", 5),
        "T = 1": (1, 1, 16, 16, "bottom_right", 1),
    }
    tq, tk, w = torch.randint(1, 130, (3,), generator=torch.Generator().manual_seed(10)).tolist()  # salted by the grader
    table[f"drawn: Tq = {tq}, Tk = {tk}, window {w}"] = (tq, tk, 16, 32, "bottom_right", w)
    return [Case(name, args, expected=_query_blocks_needed(*args), compare="equal") for name, args in table.items()]


# ----------------------------------------------------------------------------- 3. find the bug


def _shortcut_decode(query, key, value):
    """PyTorch's fused attention on K and V repeated per query head: must be refused."""
    import torch.nn.functional as F

    n_rep = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1))


def _shortcut_decode_package(query, key, value):
    """The package's own decode kernel: must be refused."""
    return _triton_decode().triton_flash_decode(query, key, value)


def _breaker_decode(query, key, value):
    """Attention of each query head over its own group's KV head in plain PyTorch: the right output, no kernel."""
    heads, kv_heads = query.shape[1], key.shape[1]
    index = torch.arange(heads) // (heads // kv_heads)  # (H,) the KV head of each query head
    k, v = key[:, index], value[:, index]  # (B, H, Tk, D)
    s = (query @ k.transpose(-2, -1)) / math.sqrt(query.shape[-1])  # (B, H, 1, Tk)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p / p.sum(-1, keepdim=True)) @ v  # (B, H, 1, D)


@exercise("10-find-the-bug-1", "decode_fixed", points=2, category="bug", aliases=("10-decode-bug",),
          allow=(), ops=("attention", "softmax", "aten::repeat_interleave"),
          prop=edits.kernel_prop(FIX_DECODE, "decode_kernel_fixed", also=in_kernel),
          prop_doc="the fix is in the kernel: a launch on every case, no PyTorch arithmetic or gather of heads "
                   "outside it, and every kernel launched is the given one with a small edit where it is wrong",
          breakers=(_breaker_decode,),
          forbid=("torch.nn.functional.scaled_dot_product_attention", "attncourse.sdpa.scaled_dot_product_attention",
                  "attncourse.gqa.grouped_attention", "attncourse.mha.repeat_kv", "torch.repeat_interleave",
                  "attncourse.triton_decode.triton_flash_decode", "attncourse.triton_decode.split_kv_partials",
                  "attncourse.triton_flash.triton_flash_attention",
                  "attncourse.triton_flash.triton_flash_attention_forward"),
          shortcuts=(_shortcut_decode, _shortcut_decode_package),
          bug_words=("modulo", "remainder", "% n_kv", "interleave", "// group", "which KV head", "wrong KV head",
                     "consecutive query heads", "adjacent query heads", "round-robin", "round robin", "cyclic"),
          hint="run it with more query heads than KV heads (8 over 2, 6 over 3) and compare each query head's output "
               "with the oracle: which heads come out wrong, and which are right?")
def _decode_bug_cases():
    """Find and fix the bug in a one-token decode kernel.

    Graded as a small edit (checks/edits.py) of the kernel: the answer is a launcher, and the guard records the
    source of every @triton.jit kernel it launches (``policy(source=True)``), each judged against the given
    kernel (checks/ch10_given.py); ``in_kernel`` keeps the work in the kernel."""
    gen = torch.Generator().manual_seed(12)
    cases = []
    for name, (b, h, h_kv, t_k, d) in {
        "MHA: 4 query heads, 4 KV heads": (1, 4, 4, 21, 16),
        "GQA: 8 query heads over 2 KV heads": (1, 8, 2, 24, 16),
        "GQA: 6 query heads over 3 KV heads, batch 2": (2, 6, 3, 17, 8),
        "MQA: 4 query heads over 1 KV head": (1, 4, 1, 20, 16),
        "GQA: 4 over 2, one key": (1, 4, 2, 1, 16),
    }.items():
        q = torch.randn(b, h, 1, d, generator=gen)
        k, v = (torch.randn(b, h_kv, t_k, d, generator=gen) for _ in range(2))
        expected = scaled_dot_product_attention(q, repeat_kv(k, h // h_kv), repeat_kv(v, h // h_kv))
        cases.append(Case(name, (q, k, v), expected=expected, rtol=1e-5, atol=2e-5))
    return cases


# ----------------------------------------------------------------------------- 4. predict


# (the prediction, 10-predict-decode, lives in ch10_predict.py)


# ----------------------------------------------------------------------------- 5. experiment


SPLIT_EXPERIMENT = dict(batch=1, heads=4, kv_heads=1, k_len=128, head_dim=32, splits=(1, 4, 16))


def split_errors_reference(seed: int) -> torch.Tensor:
    """Max |decode - oracle| (oracle in float64) for each number of splits, on the seeded float32 inputs, with the
    kernel on :func:`attncourse.triton_common.device` (a GPU if there is one, else the interpreter)."""
    from attncourse import triton_common

    td, e = _triton_decode(), SPLIT_EXPERIMENT
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(e["batch"], e["heads"], 1, e["head_dim"], generator=gen)
    k = torch.randn(e["batch"], e["kv_heads"], e["k_len"], e["head_dim"], generator=gen)
    v = torch.randn(e["batch"], e["kv_heads"], e["k_len"], e["head_dim"], generator=gen)
    n_rep = e["heads"] // e["kv_heads"]
    exact = scaled_dot_product_attention(q.double(), repeat_kv(k, n_rep).double(), repeat_kv(v, n_rep).double())
    q, k, v = (x.to(triton_common.device()) for x in (q, k, v))
    return torch.tensor([(td.triton_flash_decode(q, k, v, num_splits=s).double().cpu() - exact).abs().max().item()
                         for s in e["splits"]], dtype=torch.float64)


@exercise("10-split-experiment", "split_errors", points=2, category="experiment",
          allow=("attncourse.triton_decode.triton_flash_decode", "attncourse.sdpa.scaled_dot_product_attention",
                 "attncourse.mha.repeat_kv"),
          hint="draw q, then k, then v from one generator seeded with `seed`, in float32, with the shapes given; "
               "compare each decode with the oracle in float64 over K and V repeated per query head, and keep the "
               "largest absolute difference for each number of splits")
def _split_experiment_cases():
    """Does splitting the keys cost accuracy? Float32 decode error against the number of splits, per seed."""
    # The errors are float32 roundings (~1e-7) that move with the order of the additions: no seed here gives three
    # equal numbers, so one decode copied three times, a constant or a formula fails; the kernel is
    # deterministic, so a learner's own run matches the reference to the last bits.
    return [Case(f"seed {seed}", (seed,), expected=split_errors_reference(seed), rtol=1e-3, atol=0.0)
            for seed in (0, 2, 4)]


# ----------------------------------------------------------------------------- 6. the capstone: the whole forward


def _forward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """(out, lse) of softmax attention over (BH, T, D) inputs, in float64: the definition."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (BH, T, T)
    if is_causal:
        t = q.shape[-2]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), _NEG_INF)
    return safe_softmax(scores) @ v, torch.logsumexp(scores, dim=-1)


def _shortcut_forward_package(q, k, v, is_causal=False):
    """The package's own forward kernel: must be refused."""
    from attncourse import triton_common

    if not torch.cuda.is_available():
        triton_common.enable_interpreter()
    from attncourse.triton_flash import triton_flash_attention_forward

    return triton_flash_attention_forward(q, k, v, is_causal=is_causal)


def _breaker_forward(q, k, v, is_causal=False):
    """The tiled online softmax written in PyTorch, tile by tile: the right numbers, no kernel."""
    bh, t, d = q.shape
    m = torch.full((bh, t), _NEG_INF)
    l, acc = torch.zeros(bh, t), torch.zeros(bh, t, d)
    rows = torch.arange(t)[:, None]
    for start in range(0, t, 16):
        s = q @ k[:, start:start + 16].transpose(-2, -1) / math.sqrt(d)  # (BH, T, 16)
        if is_causal:
            s = s.masked_fill(torch.arange(start, min(start + 16, t))[None, :] > rows, _NEG_INF)
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v[:, start:start + 16]
        m = m_new
    return acc / l[..., None], m + torch.log(l)


@exercise("10-forward-kernel", "flash_forward", points=4, category="implement",
          allow=(), ops=("attention", "softmax", "logsumexp"), prop=in_kernel,
          prop_doc="the whole forward runs in the learner's Triton kernel: a launch on every case, no PyTorch "
                   "arithmetic outside it",
          breakers=(_breaker_forward,), shortcuts=(_shortcut_forward_package,),
          forbid=("torch.nn.functional.scaled_dot_product_attention", "attncourse.sdpa.scaled_dot_product_attention",
                  "attncourse.triton_flash.triton_flash_attention", "attncourse.triton_flash.triton_flash_attention_forward",
                  "attncourse.triton_decode.triton_flash_decode", "attncourse.flash.flash_attention_forward"),
          hint="one program per (block of query rows, batch-head); per row keep the running max, the running sum and "
               "an unnormalised output; for each key tile compute the scores on the tensor cores, hide the keys past "
               "the end (and, causally, the keys after the row), update the max and rescale what you have before "
               "adding the tile; divide once at the end and store the log-sum-exp too. Causally, a block of rows "
               "never needs the tiles after its last row")
def _forward_kernel_cases():
    """Capstone, in Triton: FlashAttention's forward, one kernel, output and log-sum-exp."""
    from attncourse import triton_common

    gen = torch.Generator().manual_seed(11)
    tol = triton_common.tolerance(torch.float32)  # the interpreter's float32, or TF32 on a GPU
    cases = []
    for name, (bh, t, d, causal, gain) in {
        "causal, 2 batch-heads, T = 37 (a partial last tile), D = 16": (2, 37, 16, True, 1.0),
        "no mask, T = 50, D = 32": (1, 50, 32, False, 1.0),
        "causal, one tile: T = 16": (1, 16, 16, True, 1.0),
        "causal, 3 batch-heads, T = 33, D = 8 (padded head dim)": (3, 33, 8, True, 1.0),
        "causal, large scores (x 20): the running max matters": (1, 40, 16, True, 20.0),
    }.items():
        q = torch.randn(bh, t, d, generator=gen) * gain  # (BH, T, D)
        k, v = torch.randn(bh, t, d, generator=gen), torch.randn(bh, t, d, generator=gen)
        out, lse = _forward_reference(q, k, v, causal)
        cases.append(Case(name, (q, k, v, causal), expected=(out.float(), lse.float()),
                          rtol=max(tol["rtol"], 1e-4), atol=max(tol["atol"], 1e-4)))
    return cases
