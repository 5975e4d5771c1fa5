"""Chapter 11's checks refuse the routes of issue 23 and of the cold review of chapters 11-12 (section 4), and routes
of the same kinds.

Each route is learner code (this file), tried through the check cell and the grader; a right answer passes.
"""

from __future__ import annotations

import math

import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks.ch11_ring import ring_bytes_measured
from exercise_routes import accepted, refused as refused_by_both
from test_exercise_standard import as_learner


def refused(exercise_id, answer, tmp_path, monkeypatch, *, because):
    """`answer` is refused by the check cell and by the grader, with `because` in both messages."""
    message, graded = refused_by_both(exercise_id, answer, tmp_path, monkeypatch, statuses=("failed",))
    assert because in message and because in graded, (message, graded)


def refuses_breakers(exercise_id, tmp_path, monkeypatch, *, because):
    for breaker in checks.get(exercise_id).breakers:
        refused(exercise_id, breaker, tmp_path, monkeypatch, because=because)


# ----------------------------------------------------------------------------- 1. tile states


def tile_states_reduce(mask, block_q, block_k):
    t_q, t_k = mask.shape
    n_q, n_k = -(-t_q // block_q), -(-t_k // block_k)
    allowed = torch.zeros(n_q * block_q, n_k * block_k, dtype=torch.long)
    real = torch.zeros_like(allowed)
    allowed[:t_q, :t_k] = mask.long()
    real[:t_q, :t_k] = 1
    count = allowed.view(n_q, block_q, n_k, block_k).sum(dim=(1, 3))
    size = real.view(n_q, block_q, n_k, block_k).sum(dim=(1, 3))
    return torch.where(count == 0, 0, torch.where(count == size, 2, 1))


def test_tile_states(tmp_path, monkeypatch):
    checks.check("11-tile-states", tile_states_reduce)

    def per_tile_row(mask, block_q, block_k):  # one row of tiles at a time, as the package's tile_states
        return torch.cat([tile_states_reduce(mask[r:r + block_q], block_q, block_k)
                          for r in range(0, mask.shape[0], block_q)])

    refused("11-tile-states", per_tile_row, tmp_path, monkeypatch, because="loops over tiles")

    def package(mask, block_q, block_k):
        from attncourse.block_sparse import tile_states
        return tile_states(lambda b, h, i, j: mask[i, j], mask.shape[0], mask.shape[1], block_q, block_k)

    refused("11-tile-states", package, tmp_path, monkeypatch, because="called attncourse.block_sparse")

    def flex_private(mask, block_q, block_k):  # the cold review's route: create_block_mask's own private reduction
        from torch.nn.attention.flex_attention import _convert_mask_to_block_mask
        t_q, t_k = mask.shape
        padded = torch.zeros(-(-t_q // block_q) * block_q, -(-t_k // block_k) * block_k, dtype=torch.bool)
        padded[:t_q, :t_k] = mask
        partial, full = _convert_mask_to_block_mask(padded[None, None], Q_BLOCK_SIZE=block_q, KV_BLOCK_SIZE=block_k,
                                                    separate_full_blocks=True)
        return partial[0, 0].long() + 2 * full[0, 0].long()

    refused("11-tile-states", flex_private, tmp_path, monkeypatch, because="_convert_mask_to_block_mask")

    def states_of_rows(rows, t_q, t_k, block_q, block_k):  # plain Python over tiles, from the mask as lists
        spans = lambda n, b: [range(a * b, min(n, (a + 1) * b)) for a in range(-(-n // b))]  # noqa: E731
        return torch.tensor([[2 if all(c) else 1 if any(c) else 0 for c in ([rows[i][j] for i in r for j in s]
                              for s in spans(t_k, block_k))] for r in spans(t_q, block_q)], dtype=torch.long)

    def bool_lists(mask, block_q, block_k):  # the cold review's route: booleans escape a float read-out budget
        return states_of_rows(mask.tolist(), *mask.shape, block_q, block_k)

    def index_lists(mask, block_q, block_k):  # integers: the allowed pairs' coordinates
        rows = [[False] * mask.shape[1] for _ in range(mask.shape[0])]
        for i, j in mask.nonzero().tolist():
            rows[i][j] = True
        return states_of_rows(rows, *mask.shape, block_q, block_k)

    for route in (bool_lists, index_lists):
        refused("11-tile-states", route, tmp_path, monkeypatch, because="numbers out of its tensors")

    def raw_bytes(mask, block_q, block_k):  # the mask's memory read through ctypes
        import ctypes
        m = mask.contiguous()
        flat = list((ctypes.c_bool * m.numel()).from_address(m.untyped_storage().data_ptr()))
        return states_of_rows([flat[i * m.shape[1]:(i + 1) * m.shape[1]] for i in range(m.shape[0])], *m.shape,
                              block_q, block_k)

    refused("11-tile-states", raw_bytes, tmp_path, monkeypatch, because="data_ptr")

    def pickled(mask, block_q, block_k):  # the mask's bytes through its pickle
        import pickle
        pickle.dumps(mask)
        return tile_states_reduce(mask, block_q, block_k)

    refused("11-tile-states", pickled, tmp_path, monkeypatch, because="__reduce_ex__")

    def printed(mask, block_q, block_k):  # cold review 9: the mask's text parsed back, then plain Python over tiles
        import re
        torch.set_printoptions(profile="full", linewidth=100000)
        text = repr(mask.int())
        torch.set_printoptions(profile="default")
        rows = [[int(x) for x in re.findall(r"\d+", line)] for line in text.split("\n") if re.search(r"\d", line)]
        return states_of_rows(rows, *mask.shape, block_q, block_k)

    refused("11-tile-states", printed, tmp_path, monkeypatch, because="torch.Tensor.__repr__")

    def formatted(mask, block_q, block_k):  # the same through format() / an f-string
        rows = [[c == "1" for c in f"{row.int()}" if c in "01"] for row in mask]
        return states_of_rows(rows, *mask.shape, block_q, block_k)

    refused("11-tile-states", formatted, tmp_path, monkeypatch, because="torch.Tensor.__format__")
    refuses_breakers("11-tile-states", tmp_path, monkeypatch, because="not the way")


# ----------------------------------------------------------------------------- 2. slot mapping


def test_slot_mapping_refuses_the_cache(tmp_path, monkeypatch):
    def cache_append(block_table, length, n_new, page_size, free_pages, last_page_shared):
        from attncourse.paged_cache import PagedKVCache
        cache = PagedKVCache(64, page_size, 1, 1, dtype=torch.float64)
        seq = cache.add_sequence()
        cache.block_tables[seq], cache.lengths[seq] = list(block_table), length
        cache.free_pages = list(free_pages)
        cache.refcount = [1] * 64
        if last_page_shared and block_table:
            cache.refcount[block_table[-1]] = 2
        cache.append(seq, torch.zeros(1, n_new, 1, dtype=torch.float64), torch.zeros(1, n_new, 1, dtype=torch.float64))
        return torch.tensor(cache.block_tables[seq]), torch.tensor(
            [p * page_size + o for p, o in (cache.slot(seq, t) for t in range(length, length + n_new))])

    refused("11-slot-mapping", cache_append, tmp_path, monkeypatch, because="called attncourse.paged_cache")


def slot_mapping_in_place(block_table, length, n_new, page_size, free_pages, last_page_shared):
    """The cold review's route 2b: the right page arithmetic on the caller's own lists (the task says copies)."""
    table, free = block_table, free_pages
    if last_page_shared and table and length % page_size:
        table[-1] = free.pop()
    slots = []
    for t in range(length, length + n_new):
        if t // page_size == len(table):
            table.append(free.pop())
        slots.append(table[t // page_size] * page_size + t % page_size)
    return torch.tensor(table, dtype=torch.long), torch.tensor(slots, dtype=torch.long)


def test_slot_mapping_refuses_an_answer_that_changes_its_arguments(tmp_path, monkeypatch):
    message, graded = refused_by_both("11-slot-mapping", slot_mapping_in_place, tmp_path, monkeypatch)
    assert "lists again" in message and "lists again" in graded, (message, graded)

    def on_copies(block_table, length, n_new, page_size, free_pages, last_page_shared):  # the same, on copies
        return slot_mapping_in_place(list(block_table), length, n_new, page_size, list(free_pages), last_page_shared)

    accepted("11-slot-mapping", on_copies, tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- 3. merging ranks


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(lse_a - ref)[..., None] * out_a + torch.exp(lse_b - ref)[..., None] * out_b, lse


def test_merge_ranks(tmp_path, monkeypatch):
    checks.check("11-merge-ranks", merge)

    def ring_private(out_a, lse_a, out_b, lse_b):  # the review's X5: ring._merge is exactly the exercise
        from attncourse.ring import _merge
        return _merge(out_a, lse_a, out_b, lse_b)

    refused("11-merge-ranks", ring_private, tmp_path, monkeypatch, because="called attncourse.ring")

    def softmax_of_lses(out_a, lse_a, out_b, lse_b):  # the weights as a softmax over the two lses
        w = torch.nan_to_num(torch.softmax(torch.stack([lse_a, lse_b]), 0))
        return w[0][..., None] * out_a + w[1][..., None] * out_b, torch.logaddexp(lse_a, lse_b)

    refused("11-merge-ranks", softmax_of_lses, tmp_path, monkeypatch, because="softmax")

    def reference(*args):
        from attncourse.classroom.checks.ch11 import _merge_reference
        return _merge_reference(*args)

    refused("11-merge-ranks", reference, tmp_path, monkeypatch, because="called attncourse.classroom")

    def read_out(out_a, lse_a, out_b, lse_b):  # every number read out into Python, then the formula in loops
        d = out_a.shape[-1]
        rows = zip(out_a.reshape(-1, d).tolist(), lse_a.reshape(-1).tolist(), out_b.reshape(-1, d).tolist(),
                   lse_b.reshape(-1).tolist())
        outs, lses = [], []
        for oa, la, ob, lb in rows:
            if la == lb == -math.inf:
                outs.append([0.0] * d)
                lses.append(-math.inf)
                continue
            m = max(la, lb)
            wa, wb = math.exp(la - m), math.exp(lb - m)
            outs.append([(wa * x + wb * y) / (wa + wb) for x, y in zip(oa, ob)])
            lses.append(m + math.log(wa + wb))
        return (torch.tensor(outs, dtype=out_a.dtype).reshape(out_a.shape),
                torch.tensor(lses, dtype=lse_a.dtype).reshape(lse_a.shape))

    refused("11-merge-ranks", read_out, tmp_path, monkeypatch, because="read")


# ----------------------------------------------------------------------------- 4. the paged ALiBi bug


def paged_decode(position_of_page):
    """A paged decode step that reads the pages one at a time with an online softmax; `position_of_page(i, p, P)`
    gives the position of the first key of page p, the i-th of the block table (pages of P tokens)."""
    def decode(query, k_pages, v_pages, block_table, length, slopes):
        h, d = query.shape
        hkv, page = k_pages.shape[1], k_pages.shape[2]
        kv_of = torch.arange(h) // (h // hkv)
        m = torch.full((h,), -math.inf, dtype=query.dtype)
        l, acc = torch.zeros(h, dtype=query.dtype), torch.zeros(h, d, dtype=query.dtype)
        for i, p in enumerate(block_table):
            n = min(page, length - i * page)
            if n <= 0:
                break
            k, v = k_pages[p, kv_of, :n], v_pages[p, kv_of, :n]
            s = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(d)
            s = s - slopes[:, None] * ((length - 1) - (position_of_page(i, p, page) + torch.arange(n)))[None, :]
            m_new = torch.maximum(m, s.amax(-1))
            alpha, e = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            l, acc, m = alpha * l + e.sum(-1), alpha[:, None] * acc + (e[:, None, :] @ v).squeeze(1), m_new
        return acc / l[:, None]

    return decode


paged_rewrite = paged_decode(lambda i, p, page: i * page)  # right values, the given step not edited: refused


def _paged_fixed():  # the minimal fix: the page's place in the table, 1 token on the given step's line 12
    from attncourse.classroom.checks.ch11_given import BUGGY_PAGED
    from test_edits import cell_function
    source = BUGGY_PAGED.replace("key_pos = p * page", "key_pos = i * page").replace("decode(", "decode_fixed(", 1)
    return cell_function(source, "paged_alibi_decode_fixed", {"torch": torch, "math": math})


paged_fixed = _paged_fixed()


def test_paged_alibi_bug(tmp_path, monkeypatch):
    checks.check("11-find-the-bug-1", paged_fixed)
    checks.check("11-paged-alibi-bug", paged_fixed)  # the old id still grades

    def scores_then_softmax(query, k_pages, v_pages, block_table, length, slopes):  # pages read one at a time,
        h, d = query.shape  # but every page's scores kept and normalised at the end: the sequence in one tensor
        hkv, page = k_pages.shape[1], k_pages.shape[2]
        kv_of = torch.arange(h) // (h // hkv)
        scores, values = [], []
        for i, p in enumerate(block_table):
            n = min(page, length - i * page)
            s = (k_pages[p, kv_of, :n] @ query[:, :, None]).squeeze(-1) / math.sqrt(d)
            scores.append(s - slopes[:, None] * ((length - 1) - (i * page + torch.arange(n)))[None, :])
            values.append(v_pages[p, kv_of, :n])
        w = torch.softmax(torch.cat(scores, -1), -1)
        return (w[:, None, :] @ torch.cat(values, 1)).squeeze(1)

    refused("11-find-the-bug-1", scores_then_softmax, tmp_path, monkeypatch, because="whole sequence")

    def dense_gather(query, k_pages, v_pages, block_table, length, slopes):  # the cold review's route: every page
        h, d = query.shape  # copied into one (n_pages, H, P, D) tensor, no dimension as long as the sequence
        hkv, page = k_pages.shape[1], k_pages.shape[2]
        kv_of = torch.arange(h) // (h // hkv)
        idx = torch.tensor(block_table)
        keys, values = k_pages[idx][:, kv_of], v_pages[idx][:, kv_of]  # (n, H, P, D)
        pos = torch.arange(len(block_table))[:, None] * page + torch.arange(page)[None, :]  # (n, P)
        s = (keys * query[None, :, None, :]).sum(-1) / math.sqrt(d) - slopes[None, :, None] * ((length - 1) - pos)[:, None]
        s = s.masked_fill((pos >= length)[:, None, :], -math.inf)
        e = torch.exp(s - s.amax(dim=(0, 2))[None, :, None])
        return (e[..., None] * values).sum(dim=(0, 2)) / e.sum(dim=(0, 2))[:, None]

    refused("11-find-the-bug-1", dense_gather, tmp_path, monkeypatch, because="whole sequence")

    with pytest.raises(checks.CheckFailed, match="out of order"):  # the bug: the case that shows it is named
        checks.check("11-find-the-bug-1", as_learner(paged_decode(lambda i, p, page: p * page)))

    def package(query, k_pages, v_pages, block_table, length, slopes):
        from attncourse.classroom.checks.ch11 import paged_alibi_reference
        return paged_alibi_reference(query, k_pages, v_pages, block_table, length, slopes)

    refused("11-find-the-bug-1", package, tmp_path, monkeypatch, because="called attncourse")
    refused("11-find-the-bug-1", as_learner(paged_rewrite), tmp_path, monkeypatch, because="not the way")
    breakers = checks.get("11-find-the-bug-1").breakers
    refused("11-find-the-bug-1", breakers[0], tmp_path, monkeypatch, because="whole sequence")
    refused("11-find-the-bug-1", breakers[1], tmp_path, monkeypatch, because="not the way")


# ----------------------------------------------------------------------------- 5. predict the ring's bytes


def test_ring_bytes_prediction(tmp_path, monkeypatch):
    def counted(batch, n_kv_heads, seq_len, head_dim, world_size, bytes_per_element, grad_bytes):
        block = batch * n_kv_heads * (seq_len // world_size) * head_dim  # elements of one (B, Hkv, T/W, D) block
        forward = 2 * (world_size - 1) * block * bytes_per_element  # K and V, W - 1 sends
        backward = forward + 2 * world_size * block * grad_bytes  # K and V again; dK and dV W times
        return backward, forward + backward

    checks.check("11-ring-bytes", counted)

    def checker_measurement(batch, n_kv_heads, seq_len, head_dim, world_size, bytes_per_element, grad_bytes):
        from attncourse.classroom.checks.ch11_ring import ring_bytes_measured
        forward, backward = ring_bytes_measured(batch, n_kv_heads, seq_len, head_dim, world_size, bytes_per_element,
                                                grad_bytes)
        return backward, forward + backward

    refused("11-ring-bytes", checker_measurement, tmp_path, monkeypatch, because="called attncourse")
    # The checker's expected values are a measurement (the ring run with a stand-in process group), not a formula a
    # learner could transcribe: no closed form for the backward ring is left in the check modules.
    import inspect

    from attncourse.classroom.checks import ch11, ch11_ring
    assert "def ring_backward_bytes" not in inspect.getsource(ch11) + inspect.getsource(ch11_ring)
    assert "RingAttentionFunction.backward" in inspect.getsource(ch11_ring.ring_bytes_measured)

    def forward_twice(batch, n_kv_heads, seq_len, head_dim, world_size, bytes_per_element, grad_bytes):
        block = batch * n_kv_heads * (seq_len // world_size) * head_dim * bytes_per_element
        return 4 * (world_size - 1) * block, 6 * (world_size - 1) * block

    def fitted(dtype_of):  # the law fitted to the lesson's one-dtype runs (4 (W - 1) + 2 blocks), in one dtype
        def fit(batch, n_kv_heads, seq_len, head_dim, world_size, bytes_per_element, grad_bytes):
            block = batch * n_kv_heads * (seq_len // world_size) * head_dim
            backward = (4 * (world_size - 1) + 2) * block * dtype_of(bytes_per_element, grad_bytes)
            return backward, backward + 2 * (world_size - 1) * block * bytes_per_element
        return fit

    for wrong in (forward_twice, fitted(lambda kv, g: kv), fitted(lambda kv, g: g)):
        with pytest.raises(checks.CheckFailed, match="prediction is not right"):
            checks.check("11-ring-bytes", wrong)
    # what the ring sends, counted by hand: 2 ranks, blocks of 1 head x 2 positions x 4 dims (8 elements); K, V in
    # bfloat16 once forward and once backward (32 bytes each), dK, dV in float32 twice (2 x 2 x 8 x 4 = 128 bytes)
    assert ring_bytes_measured(1, 1, 4, 4, 2, 2, 4) == (32, 32 + 128)
    assert ring_bytes_measured(1, 1, 4, 4, 2, 2) == (32, 32 + 64)  # one dtype for all


# ----------------------------------------------------------------------------- 6. the chunking experiment


def test_chunking_experiment(tmp_path, monkeypatch):
    from attncourse.scheduler import A100_7B

    def reference(seed):
        from attncourse.classroom.checks.ch11 import budget_reference
        return budget_reference(seed)

    with pytest.raises(checks.CheckFailed, match="called attncourse.classroom"):
        checks.check("11-chunking-experiment", reference)

    def rule(seed):  # a rule read off the lesson: 128 tokens, full throughput, one step's time
        return torch.tensor([128.0, 1.0, A100_7B(128)], dtype=torch.float64)

    with pytest.raises(checks.CheckFailed):
        checks.check("11-chunking-experiment", rule)


# ----------------------------------------------------------------------------- 7. KIVI's key cache


def kivi_groups(k, bits, group):
    full = k.shape[-2] - k.shape[-2] % group
    out = k.clone()
    for s in range(0, full, group):
        g = k[..., s:s + group, :]
        lo, hi = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
        step = (hi - lo) / (2 ** bits - 1)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        out[..., s:s + group, :] = torch.where(step > 0, torch.round((g - lo) / safe) * safe + lo, g)
    return out


def test_kivi_keys(tmp_path, monkeypatch):
    checks.check("11-kivi-keys", kivi_groups)

    def per_token(k, bits, group):  # one scale per token: the outlier channel sets every token's step
        return _along(k, bits, group, dim=-1)

    def whole_sequence(k, bits, group):  # one scale per channel over all the full groups at once
        full = k.shape[-2] - k.shape[-2] % group
        out = k.clone()
        if full:
            out[..., :full, :] = kivi_groups(k[..., :full, :], bits, full)
        return out

    def residual_too(k, bits, group):  # the newest partial group quantised as well
        t = k.shape[-2]
        return kivi_groups(torch.cat([k, k[..., -1:, :].expand(*k.shape[:-2], (-t) % group, k.shape[-1])], -2),
                           bits, group)[..., :t, :]

    for wrong in (per_token, whole_sequence, residual_too):
        with pytest.raises(checks.CheckFailed):
            checks.check("11-kivi-keys", as_learner(wrong))
    def torch_quantiser(k, bits, group):  # PyTorch's own per-channel fake quantiser, group by group
        full = k.shape[-2] - k.shape[-2] % group
        parts = []
        for s in range(0, full, group):
            g = k[..., s:s + group, :].transpose(-1, -2).reshape(-1, group).float()  # (channels, group)
            lo = g.amin(-1, keepdim=True)
            scale = ((g.amax(-1) - lo[:, 0]) / (2 ** bits - 1)).clamp_min(1e-12)
            q = torch.fake_quantize_per_channel_affine(g - lo, scale, torch.zeros_like(scale, dtype=torch.int32), 0,
                                                       0, 2 ** bits - 1) + lo
            parts.append(q.reshape(*k.shape[:-2], k.shape[-1], group).transpose(-1, -2).to(k.dtype))
        return torch.cat(parts + [k[..., full:, :]], -2)

    refused("11-kivi-keys", torch_quantiser, tmp_path, monkeypatch, because="fake_quantize_per_channel_affine")


def _along(k, bits, group, dim):
    full = k.shape[-2] - k.shape[-2] % group
    out = k.clone()
    for s in range(0, full, group):
        g = k[..., s:s + group, :]
        lo, hi = g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
        step = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-300)
        out[..., s:s + group, :] = torch.round((g - lo) / step) * step + lo
    return out
