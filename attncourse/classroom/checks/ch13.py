"""Checks for chapter 13, attention without the softmax (solutions/13_linear_attention.ipynb).

Expected values come from the package (:mod:`attncourse.linear_attention`, :mod:`attncourse.recall`,
:mod:`attncourse.hybrid`) in float64, never from a copy of the solution.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

from attncourse import linear_attention as la
from attncourse.recall import memory_recall
from . import Case, edits, exercise
from .ch11 import READ_AROUND as _READ_AROUND  # a tensor's numbers reached around the trace's read count
from .ch13_breakers import (BUGGY_GDN, _breaker_gdn_rewrite, _breaker_chunk_loop, _breaker_gdn_all_chunks_solved_at_once,  # noqa: E402
                            _breaker_gdn_token_loop, _breaker_quadratic, _breaker_rows_against_all_keys,
                            _breaker_token_loop)

_MATMUL = re.compile(r"^(mm|bmm|addmm|baddbmm|matmul|mv|addbmm|einsum)$")  # matrix products, as the trace names them

def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _inputs(gen, B, H, T, Dk, Dv, delta=False, channels=False):
    q = _randn(gen, B, H, T, Dk)
    k = F.normalize(_randn(gen, B, H, T, Dk), dim=-1)
    v = _randn(gen, B, H, T, Dv)
    g = F.logsigmoid(_randn(gen, B, H, T) + 2.0)  # log-decays in (-inf, 0), most near 0
    if channels:  # one log-decay per key channel (GLA, Kimi Delta Attention)
        g = F.logsigmoid(_randn(gen, B, H, T, Dk) + 2.0)
    if not delta:
        return q, k, v, g
    return q, k, v, g, torch.rand(B, H, T, generator=gen, dtype=torch.float64)


# ----------------------------------------------------------------------------- the property: chunk by chunk


def _chunks(run) -> tuple[int, int, int]:
    q, chunk = run.case.args[0], run.case.args[-1]
    T = q.shape[2]
    return T, chunk, -(-T // chunk)


def _work(run) -> int:
    return sum((run.trace or {}).get("counts", {}).values()) + (run.trace or {}).get("dropped", 0)


def _elements(run) -> int:
    """How many tensor elements the answer's operators took in, whatever their layout (the work it did)."""
    total = 0
    for _name, _launch, _helper, tensors in (run.trace or {}).get("ops", []):
        for _label, _offset, shape, _stride in tensors:
            n = 1
            for d in shape:
                n *= int(d)
            total += n
    return total


def _chunk_by_chunk(runs) -> str | None:
    """Only the state crosses a chunk boundary: no tensor relates more than a chunk of positions to a chunk or
    more of others (no (T, T) scores, no chunk of queries against all earlier keys, in any layout), the elements
    the operators take in grow linearly with T at a fixed chunk size, and the work does not grow with the tokens
    per chunk (no loop over tokens); and the work is done as matrix products over chunk-sized blocks (one chunk at a
    time or all chunks batched) that take in at least the entries of q, k and v (not token by token, not outside PyTorch)."""
    for run in runs:
        T, chunk, n = _chunks(run)
        for name, _launch, _helper, tensors in (run.trace or {}).get("ops", []):
            for _label, _offset, shape, _stride in tensors:
                dims = sorted(shape[-2:], reverse=True)  # the matrix an operator works on (other layouts: see below)
                if len(dims) == 2 and dims[0] > chunk and dims[1] >= chunk and dims[0] > n + 1:  # (n+1, n+1): chunks
                    return (f"case '{run.case.name}': your code ran {name.split('::')[-1]} on a tensor of shape "
                            f"{tuple(shape)}: it relates more than a chunk ({chunk}) of positions to a chunk or more "
                            "of others, so its cost grows as T^2; carry the state from chunk to chunk instead")
    by_size = {}
    for run in runs:
        T, chunk, _ = _chunks(run)
        if (run.trace or {}).get("dropped", 0):
            return (f"case '{run.case.name}': your code ran more than 20000 PyTorch operations for {T} tokens; "
                    "treat each chunk as a whole")
        by_size.setdefault(chunk, []).append((T, _elements(run)))
    for chunk, rows in by_size.items():
        (t_few, e_few), (t_many, e_many) = min(rows), max(rows)
        if t_many >= 4 * t_few and e_many > (t_many / t_few) ** 1.5 * max(e_few, 1):
            return (f"with chunks of {chunk}, your code's operators take in {e_many} tensor elements for {t_many} "
                    f"tokens and {e_few} for {t_few}: {e_many / max(e_few, 1):.0f} times as much for "
                    f"{t_many // t_few} times the tokens, so its cost grows as T^2 (some tensor relates every "
                    "position to every other, however it is shaped); carry the state from chunk to chunk instead")
    by_chunks = {}
    for run in runs:
        T, _, n = _chunks(run)
        by_chunks.setdefault(n, []).append((T, _work(run)))
    for n, rows in by_chunks.items():
        (t_few, w_few), (t_many, w_many) = min(rows), max(rows)
        if t_many > t_few and w_many > w_few + 8:
            return (f"your code runs {w_many} PyTorch operations for {t_many} tokens and {w_few} for {t_few}, in "
                    f"{n} chunks both times: the number of operations grows with the tokens inside a chunk (a loop "
                    "over tokens, or a scan over them in log-many steps); treat each chunk as a whole")
    for run in runs:
        T, chunk, n = _chunks(run)
        q, k, v = run.case.args[:3]
        products = [tensors for name, _l, _h, tensors in (run.trace or {}).get("ops", [])
                    if _MATMUL.match(name.split("::")[-1].split(".")[0]) and len(tensors) >= 2]
        chunked = [ts for ts in products if any(min(chunk, T) in shape[-2:] for _a, _o, shape, _s in ts)]
        taken = sum(math.prod(int(x) for x in shape) for ts in chunked for _a, _o, shape, _s in ts)
        if not chunked or taken < q.numel() + k.numel() + v.numel():
            return (f"case '{run.case.name}': your code ran {len(chunked)} matrix products over chunk-sized blocks "
                    f"(taking in {taken} entries) for {n} chunks of {chunk} tokens and {q.numel() + k.numel() + v.numel()} "
                    "entries of q, k and v: the chunked form does its work as matrix products over whole chunks "
                    "of queries, keys and values (with torch, not in plain Python)")
    return None


def _no_chunk_loop(runs) -> str | None:
    """Every chunk at once (Mamba-2's ``ssd_minimal``): at a fixed chunk size, the operator count does not grow with
    the number of chunks (T = 32 and 128 in chunks of 8: 4 and 16 chunks), so no Python loop steps from chunk to
    chunk; the states between chunks come from one product with a chunk-level decay matrix."""
    other = _chunk_by_chunk(runs)
    if other:
        return other
    by_chunk = {}
    for run in runs:
        T, chunk, n = _chunks(run)
        by_chunk.setdefault(chunk, []).append((n, _work(run)))
    for chunk, rows in by_chunk.items():
        (n_few, w_few), (n_many, w_many) = min(rows), max(rows)
        if n_many > n_few and w_many - w_few >= n_many - n_few:
            return (f"with chunks of {chunk}, your code runs {w_many} PyTorch operations for {n_many} chunks and "
                    f"{w_few} for {n_few}: the work grows with the number of chunks, so it steps from chunk to chunk; "
                    "this exercise asks for every chunk at once, the states between chunks included")
    return None


def _read_out(run) -> int:
    """Numbers the answer read out of its tensors into plain Python: every `tolist()` and storage read (any dtype,
    ``trace["read"]``) and every `item()`, `float(t)`, `int(t)` or `bool(t)` (one ``_local_scalar_dense`` each)."""
    trace = run.trace or {}
    return trace.get("read", 0) + trace.get("counts", {}).get("aten::_local_scalar_dense", 0)


_READ_MOST = 32  # numbers per call: a flag or a size, never the per-chunk summaries (48 or more even for one chunk)


def _every_chunk_in_torch(runs) -> str | None:
    """:func:`_no_chunk_loop`, and the chunk-to-chunk recurrence stays in PyTorch: an answer that reads the chunks'
    summaries out (`tolist()` once) and steps the states from chunk to chunk in plain Python runs a constant number
    of operators, so the operator count alone does not see its loop; the numbers it reads out do (review 12b)."""
    for run in runs:
        T, chunk, n = _chunks(run)
        if _read_out(run) > _READ_MOST:
            return (f"case '{run.case.name}': your code read {_read_out(run)} numbers out of its tensors into plain "
                    f"Python (tolist, item, float) for {n} chunk(s): the states between chunks are computed outside "
                    "PyTorch; compute them with tensor operations, every chunk at once")
    return _no_chunk_loop(runs)


# ----------------------------------------------------------------------------- 1. chunkwise decayed linear attention


def _decay_reference(q, k, v, g, initial_state, chunk_size):
    """(o, boundary states): the recurrence from `initial_state`, chunk after chunk; the states (B, H, n + 1, Dk, Dv)
    are the one before each chunk, then the final one."""
    S, outs, states = initial_state, [], [initial_state]
    for a in range(0, q.shape[2], chunk_size):
        o, S = la.recurrent(*(x[:, :, a:a + chunk_size] for x in (q, k, v, g)), scale=1.0, initial_state=S)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 2), torch.stack(states, 2)


def _shortcut_chunked(q, k, v, g, initial_state, chunk_size):
    """The package's chunked form, one chunk per call to collect the boundary states: must be refused."""
    S, outs, states = initial_state, [], [initial_state]
    for a in range(0, q.shape[2], chunk_size):
        o, S = la.chunked(*(x[:, :, a:a + chunk_size] for x in (q, k, v, g)), chunk_size=chunk_size, scale=1.0,
                          initial_state=S)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 2), torch.stack(states, 2)


def boundary_states(k, v, g, initial_state, chunk_size):
    """(B, H, n + 1, Dk, Dv): the state before each chunk and after the last, carried chunk by chunk, with one log-decay
    per key channel, g (B, H, T, Dk). Shared with tests/test_ch13_checks.py, which runs it as learner code
    (``as_learner``) so that the guard does not refuse the call into this module."""
    S, states = initial_state, [initial_state]
    for a in range(0, k.shape[2], chunk_size):
        kc, vc, G = k[:, :, a:a + chunk_size], v[:, :, a:a + chunk_size], g[:, :, a:a + chunk_size].cumsum(-2)
        S = S * G[..., -1, :, None].exp() + (kc * (G[..., -1:, :] - G).exp()).transpose(-2, -1) @ vc
        states.append(S)
    return torch.stack(states, 2)


def _shortcut_parallel(q, k, v, g, initial_state, chunk_size):
    """The package's masked (T, T) form for the outputs (plus the initial state's share), the states by hand: must be
    refused."""
    o = la.parallel(q, k, v, g, scale=1.0) + (q * g.cumsum(-2).exp()) @ initial_state
    return o, boundary_states(k, v, g, initial_state, chunk_size)


def _with_package_mask(mask_of, name: str):
    """A chunk-by-chunk answer whose intra-chunk decay masks (one per key channel) come from the package
    (`mask_of(g_chunk)`, (B, H, Dk, c, c)): refused."""
    def shortcut(q, k, v, g, initial_state, chunk_size):
        S = initial_state
        outs, states = [], [S]
        for a in range(0, q.shape[2], chunk_size):
            qc, kc, vc, gc = (x[:, :, a:a + chunk_size] for x in (q, k, v, g))
            G = gc.cumsum(-2)
            w = torch.einsum("bhrc,bhsc,bhcrs->bhrs", qc, kc, mask_of(gc.transpose(-2, -1)))
            outs.append((qc * G.exp()) @ S + w @ vc)
            S = S * G[..., -1, :, None].exp() + (kc * (G[..., -1:, :] - G).exp()).transpose(-2, -1) @ vc
            states.append(S)
        return torch.cat(outs, 2), torch.stack(states, 2)

    shortcut.__name__ = shortcut.__qualname__ = name
    return shortcut


_shortcut_segsum = _with_package_mask(lambda gc: la.segsum(gc).exp(), "_shortcut_segsum")
_shortcut_decay_mask = _with_package_mask(lambda gc: la.decay_mask(gc), "_shortcut_decay_mask")


# Every form and helper of the package that computes a decayed linear attention or a piece of it (the decay mask,
# the decayed products, the scan): the two chunkwise exercises ask for these to be written.
_PACKAGE_FORMS = tuple(f"attncourse.linear_attention.{name}" for name in (
    "chunked", "parallel", "recurrent", "recurrent_step", "decay_mask", "segsum", "ssm_scan", "_decayed_products"))

_CHUNK_SPECS = ((32, 8), (64, 16), (128, 32), (45, 16), (8, 8), (128, 8))  # (T, chunk): 4, 4, 4, 3, 1, 16 chunks


@exercise("13-chunked-decay", "chunked_decay_attention", points=3, category="implement",
          forbid=_PACKAGE_FORMS + _READ_AROUND, allow=(), ops=("attention", "softmax", "logsumexp"),
          shortcuts=(_shortcut_chunked, _shortcut_parallel, _shortcut_segsum, _shortcut_decay_mask),
          prop=_every_chunk_in_torch,
          breakers=(_breaker_chunk_loop, _breaker_token_loop, _breaker_quadratic, _breaker_rows_against_all_keys),
          prop_doc="every chunk at once, in PyTorch: no more than a few numbers read out of the tensors into "
                   "plain Python (tolist, item, float: a chunk recurrence stepped on lists is refused), the operator "
                   "count grows neither with the tokens per chunk (T = 32, 64, 128 "
                   "in 4 chunks) nor with the number of chunks (T = 32 and 128 in chunks of 8), and no tensor relates "
                   "more than a chunk of positions to a chunk or more of others (in any layout: the elements the "
                   "operators take in grow linearly in T at a fixed chunk size)",
          title="Decayed linear attention with one decay per key channel, every chunk at once, with its boundary "
                "states",
          hint="pad to whole chunks with tokens that change nothing and give the chunks their own axis. With one decay "
               "per key channel, the decay from token s to token r inside a chunk differs per channel: it is the "
               "exponential of a difference of cumulative sums of that channel's g taken inside the chunk, so it "
               "enters the sum over channels that makes the score, not a factor outside it. Each chunk adds to the "
               "state at its end its keys times their values, each key channel decayed by what remains of the chunk "
               "after it. The states at the boundaries follow the same recurrence, one step per chunk, each key "
               "channel (each row of the state) with its own decay: a decay tensor over pairs of boundaries, one "
               "per channel, applied to the chunks' contributions, the initial state counted as the zeroth")
def _chunked_decay():
    """Causal linear attention with a log-decay per token, head and key channel (GLA, Kimi Delta Attention's gate
    without the delta rule), every chunk at once."""
    gen = torch.Generator().manual_seed(13)
    cases = []
    for T, chunk in _CHUNK_SPECS:
        q, k, v, g = _inputs(gen, 2, 2, T, 4, 3, channels=True)
        if T == 64:
            g = torch.zeros_like(g)  # no decay: plain linear attention
        if T == 32:  # one decay per head, the same on every channel (Mamba-2's and RetNet's case)
            g = g[..., :1].expand_as(g).contiguous()
        if T == 45:  # very strong decays (about e^-800 over a chunk): e^G underflows to 0 in float64, so the decay
            g = -100.0 * torch.rand(g.shape, generator=gen, dtype=torch.float64)  # must be e^(G_r - G_s), not a ratio
        if T == 128 and chunk == 32:  # channels that forget at very different rates, as a trained gate's do
            g = g * torch.tensor([0.01, 0.3, 3.0, 10.0], dtype=torch.float64)
        s0 = torch.zeros(2, 2, 4, 3, dtype=torch.float64) if T == 8 else 0.5 * _randn(gen, 2, 2, 4, 3)
        cases.append(Case(f"T = {T}, chunks of {chunk}" + (", g = 0" if T == 64 else "") +
                          (", one decay per head" if T == 32 else "") +
                          (", channels decaying at very different rates" if (T, chunk) == (128, 32) else "") +
                          (", very strong decay" if T == 45 else "") + (", zero initial state" if T == 8 else ""),
                          (q, k, v, g, s0, chunk), expected=_decay_reference(q, k, v, g, s0, chunk),
                          rtol=1e-7, atol=1e-8))
    return cases


# ----------------------------------------------------------------------------- 2. find the bug (gated delta rule)


def _gdn_reference(q, k, v, g, beta, initial_state, chunk_size):
    """(o, boundary states): the recurrence from `initial_state`, run chunk after chunk; the states (B, H, n + 1, Dk,
    Dv) are the one before each chunk, then the final one."""
    S, outs, states = initial_state, [], [initial_state]
    for a in range(0, q.shape[2], chunk_size):
        o, S = la.recurrent(*(x[:, :, a:a + chunk_size] for x in (q, k, v, g, beta)), scale=1.0, initial_state=S)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 2), torch.stack(states, 2)


def _fixed_in_place(runs) -> str | None:
    """The given code fixed, not replaced: still chunk by chunk (:func:`_chunk_by_chunk`), and still one triangular
    solve for each chunk's writes, inside the chunk loop (a rewrite that solves every chunk at once is another
    function, such as the package's)."""
    other = _chunk_by_chunk(runs)
    if other:
        return other
    for run in runs:
        _T, _chunk, n = _chunks(run)
        solves = sum(1 for name, *_ in (run.trace or {}).get("ops", []) if "solve_triangular" in name)
        if solves < n:
            return (f"case '{run.case.name}': your code ran {solves} triangular solve(s) for {n} chunks: fix the "
                    "given function where it is wrong and keep its form, one solve per chunk for that chunk's writes")
    return None


@exercise("13-find-the-bug-1", "gated_delta_chunked_fixed", points=2, category="bug",
          forbid=_PACKAGE_FORMS, allow=(), ops=("attention", "softmax", "logsumexp"),
          prop=edits.prop(edits.SmallEdit(BUGGY_GDN, most=4, lines=(16,)), "`gated_delta_chunked_fixed`",
                          also=_fixed_in_place),
          breakers=(_breaker_gdn_token_loop, _breaker_gdn_all_chunks_solved_at_once, _breaker_gdn_rewrite),
          prop_doc="the given code fixed, still chunkwise: no (T, T) or chunk-against-all-keys tensor in any layout "
                   "(the elements the operators take in grow linearly in T at a fixed chunk size), the operator count "
                   "does not grow with the tokens per chunk, and each chunk's writes are solved in the chunk loop "
                   "(one triangular solve per chunk at least); and the diagnosis: the given function with a small "
                   "edit where it is wrong (a chunkwise rule written afresh does not show the bug was found)",
          bug_words=("decayed twice", "decays twice", "decay twice", "twice decayed", "applied twice", "double decay",
                     "doubly decayed", "double-decayed", "decayed two times", "from s_end", "with s_end", "uses s_end",
                     "s_end instead", "instead of s_end", "read undecayed", "stale state",
                     "decayed over the whole chunk"),
          title="Fix a chunked gated delta rule that also returns its boundary states",
          hint="note which cases fail and which pass (with and without decay, one chunk or several, a zero or a "
               "given initial state); then take two chunks of two tokens, unroll the recurrence by hand and compare "
               "every term of the second chunk's outputs and state with what the code computes")
def _gdn_bug():
    """Fix a chunkwise gated delta rule (from an initial state, returning the state at every chunk boundary) that
    agrees with the recurrence in some cases only."""
    gen = torch.Generator().manual_seed(131)
    cases = []
    for T, chunk in _CHUNK_SPECS:
        q, k, v, g, beta = _inputs(gen, 2, 2, T, 4, 3, delta=True)
        s0 = 0.5 * _randn(gen, 2, 2, 4, 3)
        if T == 32:
            g = torch.zeros_like(g)  # DeltaNet: no gate
        if T == 8:
            s0 = torch.zeros_like(s0)  # one chunk from an empty state
        cases.append(Case(f"T = {T}, chunks of {chunk}" + (", g = 0 (DeltaNet)" if T == 32 else "") +
                          (", zero initial state" if T == 8 else ""), (q, k, v, g, beta, s0, chunk),
                          expected=_gdn_reference(q, k, v, g, beta, s0, chunk), rtol=1e-7, atol=1e-8))
    return cases


# ----------------------------------------------------------------------------- 3. predict the bytes of a hybrid


# The configuration the exercise text asks about: 32 layers, 3 Gated DeltaNet per attention layer, 4 KV heads of 128,
# 16 state heads of (128 x 128), 32,768 tokens (bfloat16 everywhere).
HYBRID_QUESTION = dict(n_layers=32, linear_per_attention=3, n_kv_heads=4, head_dim=128, n_heads=16, key_dim=128,
                       value_dim=128, seq_len=32_768)


@exercise("13-predict-hybrid-bytes", "predicted_bytes", points=1, category="predict",
          parts=("kv_cache_MiB", "state_MiB", "break_even_tokens"),
          forbid=("attncourse.hybrid.HybridConfig", "attncourse.hybrid.LayerKind", "attncourse.hybrid.attention_layers",
                  "attncourse.hybrid.linear_layers", "attncourse.hybrid.mla_layers", "attncourse.hybrid.mamba_layers",
                  "attncourse.hybrid.hybrid_config", "attncourse.hybrid.all_attention"),
          allow=(), ops=("torch",),
          prop_doc="the prediction is a rule in plain arithmetic, written as a function of the hybrid's shape so that no "
                   "package call (the hybrid byte counts, the checker's) can stand in for it: equal values on the "
                   "exercise's model and on drawn ones are the skill",
          hint="per token, an attention layer caches a key and a value for each KV head; a Gated DeltaNet layer holds "
               "one (key dim x value dim) matrix per head whatever the length. Count the layers of each kind from "
               "the schedule, then the bytes of bfloat16 (a MiB is 2^20 bytes). The break-even length compares one "
               "layer of each kind")
def _predict():
    """Predict (KV cache MiB, state MiB, break-even tokens of one layer of each kind) of a hybrid as a function of
    (n_layers, linear_per_attention, n_kv_heads, head_dim, n_heads, key_dim, value_dim, seq_len), bfloat16."""
    # The expected values come from the package's byte counts, in local names only: the checks module exposes no
    # value or function that returns the answer.
    from attncourse.hybrid import attention_layers, HybridConfig, linear_layers

    gen = torch.Generator().manual_seed(133)  # two more hybrids, drawn (a salted grader draws others)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    configs = [HYBRID_QUESTION]
    for _ in range(2):
        ratio = pick(1, 7)
        configs.append(dict(n_layers=(ratio + 1) * pick(1, 10), linear_per_attention=ratio, n_kv_heads=2 ** pick(0, 4),
                            head_dim=32 * pick(1, 8), n_heads=pick(2, 48), key_dim=32 * pick(1, 8),
                            value_dim=32 * pick(1, 8), seq_len=1024 * pick(1, 512)))
    cases = []
    for cfg in configs:
        n_attn = cfg["n_layers"] // (cfg["linear_per_attention"] + 1)
        attn = attention_layers("attention", n_attn, n_kv_heads=cfg["n_kv_heads"], head_dim=cfg["head_dim"])
        lin = linear_layers("linear", cfg["n_layers"] - n_attn, n_heads=cfg["n_heads"], key_dim=cfg["key_dim"],
                            value_dim=cfg["value_dim"])
        parts = HybridConfig("the exercise's hybrid", (attn, lin), "chapter 13, exercise 3").bytes(cfg["seq_len"])
        expected = (parts["attention"] / 2 ** 20, parts["linear"] / 2 ** 20, lin.fixed / attn.per_token)
        cases.append(Case("(kv_cache_MiB, state_MiB, break_even_tokens) for " +
                          ", ".join(f"{k}={v}" for k, v in cfg.items()), tuple(cfg.values()),
                          expected=expected, rtol=1e-3, atol=1e-3))
    return cases


# ----------------------------------------------------------------------------- 4. experiment: recall capacity


@exercise("13-recall-capacity", "recall_measured", points=2, category="experiment",
          hint="draw the keys first, then the values, each (n_pairs, dim) from the one generator, in float64, and "
               "normalise each row; write the pairs in order; read with every key; a recall is right when the "
               "stored value with the largest dot product with what you read is the key's own value")
def _recall():
    """Fraction of N random pairs a memory returns exactly, for the linear and the delta rule, over seeds."""
    cases = []
    for seed in (0, 1, 2, 3):
        for rule, n, dim in (("linear", 24, 16), ("delta", 12, 16), ("delta", 40, 16), ("linear", 40, 32),
                             ("delta", 16, 16)):
            cases.append(Case(f"seed {seed}, {rule} rule, {n} pairs in dim {dim}", (rule, n, dim, seed),
                              expected=memory_recall(rule, n, dim, seed), rtol=0, atol=1e-9))
    return cases
