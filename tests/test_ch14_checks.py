"""Chapter 14's checks refuse what a learner could hand in without the skill, by the check cell and by the grader;
the right answers pass."""

from __future__ import annotations

import math
import re

import nbformat
import pytest
import torch

from attncourse import AttentionState, finalize_attention_state, online_attention_update
from attncourse.classroom import checks
from attncourse.classroom.nbtools import ROOT
from exercise_routes import NOT_THE_WAY, accepted, as_learner, failure, refused


# The breakers (right outputs computed the wrong way) are run by check and grader for every chapter in
# test_exercise_standard.test_properties_refuse_their_breakers; here the shortcuts of every category.
@pytest.mark.parametrize("ex", [e for e in checks.exercises_for("14") if e.shortcuts], ids=lambda e: e.id)
def test_shortcuts_refused_by_check_and_grader(ex, tmp_path, monkeypatch):
    for shortcut in ex.shortcuts:
        msg, graded = refused(ex.id, shortcut, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, (shortcut.__name__, msg)


# ----------------------------------------------------------------------------- 1. the gate


def listed(sel, top_k):
    """(..., Tq, nB) bool -> (..., Tq, top_k): the chosen blocks in increasing order, then -1 (the exercise's form)."""
    nb = sel.shape[-1]
    order = torch.where(sel, torch.arange(nb), nb).sort(-1).values
    order = torch.cat([order, order.new_full((*order.shape[:-1], top_k), nb)], -1)[..., :top_k]
    return order.masked_fill(order == nb, -1)


def rank_blocks(gate, s, block_size, top_k):
    """MoBA's choice from (B, H, Tq, nB) block scores of the last Tq of s positions, as the exercise lists it."""
    t, nb = gate.shape[-2:]
    own, blocks = (s - t + torch.arange(t))[:, None] // block_size, torch.arange(nb)[None, :]
    rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)
    return listed((rank < top_k - 1) & (blocks < own) | (blocks == own), top_k)


def moba_select(query, key, block_size, top_k):
    b, h, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    nb = -(-s // block_size)
    padded = key.new_zeros(b, hkv, nb * block_size, d)
    padded[:, :, :s] = key
    sizes = torch.full((nb, 1), float(block_size), dtype=key.dtype)
    sizes[-1] = s - (nb - 1) * block_size
    means = (padded.view(b, hkv, nb, block_size, d).sum(3) / sizes).repeat_interleave(h // hkv, dim=1)
    return rank_blocks(query @ means.transpose(-2, -1), s, block_size, top_k)  # (B, H, Tq, nB) scores


def test_gate_right_answer(tmp_path, monkeypatch):
    accepted("14-moba-gate", moba_select, tmp_path, monkeypatch)


def test_gate_routes_refused(tmp_path, monkeypatch):
    def elementwise_scores(query, key, block_size, top_k):  # every q.k by broadcasting, then block means
        h, hkv, s = query.shape[1], key.shape[1], key.shape[2]
        sc = (query[..., :, None, :] * key.repeat_interleave(h // hkv, 1)[..., None, :, :]).sum(-1)  # (B, H, Tq, S)
        nb = -(-s // block_size)
        gate = torch.stack([sc[..., i * block_size:(i + 1) * block_size].mean(-1) for i in range(nb)], -1)
        return rank_blocks(gate, s, block_size, top_k)

    def wrong_causality(query, key, block_size, top_k):  # one more block than asked
        return moba_select(query, key, block_size, top_k + 1)[..., :top_k]

    def own_block_from_the_row(query, key, block_size, top_k):  # review 8's edited copy of moba_gate: rows as positions
        full = torch.cat([query, query.new_zeros(*query.shape[:2], key.shape[2] - query.shape[2], query.shape[-1])], 2)
        return moba_select(full, key, block_size, top_k)[:, :, :query.shape[2]]

    def padded_queries(query, key, block_size, top_k):  # a whole-prefill gate (an edited copy of moba_gate would do)
        pad = query.new_zeros(*query.shape[:2], key.shape[2] - query.shape[2], query.shape[-1])  # run on every
        return moba_select(torch.cat([pad, query], 2), key, block_size, top_k)[:, :, -query.shape[2]:]  # position

    msg, graded = refused("14-moba-gate", elementwise_scores, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded
    refused("14-moba-gate", wrong_causality, tmp_path, monkeypatch)
    msg, graded = refused("14-moba-gate", padded_queries, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded and "not asking" in msg, msg
    assert "chunk" in failure("14-moba-gate", own_block_from_the_row).split("\n")[0]


def test_gate_package_mask_is_not_an_answer():
    """Review 8: an edited copy of moba_gate passed 3/3. The exercise now asks for the queries of a chunk against
    every key so far and for index lists: the package's (B, H, T, nB) mask for a whole prefill, however computed, is
    refused by its shape."""
    def package_like(query, key, block_size, top_k):
        nb = -(-key.shape[2] // block_size)
        return torch.zeros(*query.shape[:3], nb, dtype=torch.bool)

    assert "shape" in failure("14-moba-gate", package_like)


# ----------------------------------------------------------------------------- 2. the bug


def block_gate(q, k, block):
    """MoBA's gate for (H, T, D) inputs: (H, T, nB) scores of each query against each block's mean key, and nB.
    Shared by the answers below (test code: the guard lets an answer call it)."""
    nb = -(-k.shape[1] // block)
    means = torch.stack([k[:, i * block:(i + 1) * block].mean(1) for i in range(nb)], 1)  # (H, nB, D)
    return q @ means.transpose(-2, -1), nb


def moba_attention_fixed(q, k, v, block_size, top_k):
    h, t, d = q.shape
    gate, nb = block_gate(q, k, block_size)
    own = torch.arange(t) // block_size
    earlier = torch.arange(nb)[None, :] < own[:, None]
    out = torch.empty(h, t, v.shape[-1], dtype=q.dtype)
    for hh in range(h):
        for i in range(t):
            chosen = {int(own[i])}
            if top_k > 1 and nb > 1:
                best = gate[hh, i].masked_fill(~earlier[i], -math.inf).topk(min(top_k - 1, nb - 1)).indices
                chosen |= {b for b in best.tolist() if earlier[i, b]}
            m0 = q.new_full((1,), -math.inf)
            state = AttentionState(m0, torch.zeros_like(m0), q.new_zeros(1, v.shape[-1]))
            for b in sorted(chosen):
                k0, k1 = b * block_size, min((b + 1) * block_size, t)
                s = q[hh, i:i + 1] @ k[hh, k0:k1].transpose(-2, -1) / math.sqrt(d)
                if b == own[i]:
                    s = s.masked_fill(torch.arange(k0, k1)[None, :] > i, -math.inf)
                state = online_attention_update(state, s, v[hh, k0:k1])
            out[hh, i] = finalize_attention_state(state)[0][0]
    return out


def test_bug_right_answer_and_library_routes(tmp_path, monkeypatch):
    # the check cell passes the fix typed as an edit of the given code (the grader's full points: test_notebooks)
    from attncourse.classroom.checks.ch14_breakers import BUGGY_MOBA
    from test_edits import cell_function
    from attncourse import AttentionState as State, finalize_attention_state as finish, online_attention_update as upd

    ns = {"torch": torch, "math": math, "AttentionState": State, "finalize_attention_state": finish,
          "online_attention_update": upd}
    for old, new in (("set(best.tolist())", "{b for b in best.tolist() if earlier[i, b]}"),
                     ("min(top_k - 1, nb - 1)", "min(top_k - 1, int(earlier[i].sum()))"),
                     ("in sorted(chosen)", "in sorted(b for b in chosen if b <= own[i])")):  # filtered in the loop
        edited = cell_function(BUGGY_MOBA.replace(old, new).replace("attention(", "attention_fixed("),
                               "moba_attention_fixed", ns)
        checks.check("14-find-the-bug-1", edited)
    with pytest.raises(checks.CheckFailed, match="not the way"):  # right values, written afresh
        checks.check("14-find-the-bug-1", moba_attention_fixed)
    from attncourse.learned_sparse import blocks_to_mask, moba_gate, selected_attention

    def package(q, k, v, block, top_k):
        sel = moba_gate(q[None], k[None], block, top_k)
        return selected_attention(q[None], k[None], v[None], sel, block).out[0]

    def by_hand_softmax(q, k, v, block, top_k):
        sel = moba_gate(q[None], k[None], block, top_k)[0]
        s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~blocks_to_mask(sel, block, q.shape[1]),
                                                                             -math.inf)
        return torch.softmax(s, -1) @ v

    for route in (package, by_hand_softmax):
        assert "called" in refused("14-find-the-bug-1", route, tmp_path, monkeypatch)[0], route.__name__


def test_bug_words_stay_out_of_the_notebooks():
    ex = checks.get("14-find-the-bug-1")
    for path in (ROOT / "exercises" / "14_learned_sparse_attention.ipynb",
                 ROOT / "notebooks" / "14_learned_sparse_attention.ipynb"):
        nb = nbformat.read(path, as_version=4)
        text = "\n".join(c.source for c in nb.cells if "solution-only" not in c.metadata.get("tags", []))
        for word in ex.bug_words:
            assert not re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}", text, flags=re.IGNORECASE), (path.name, word)


# ----------------------------------------------------------------------------- 3. predict


def tiles_prediction(seq_len, block_size, top_k):
    nb = -(-seq_len // block_size)
    last = seq_len - (nb - 1) * block_size
    m = min(top_k, nb)
    blocks = block_size * (m * (m + 1) // 2 + (nb - m) * top_k) - (block_size - last) * m
    own = (nb - 1) * block_size * (block_size + 1) // 2 + last * (last + 1) // 2
    return blocks, own + block_size * (blocks - seq_len)


def per_query_count(seq_len, block_size, top_k):  # the same count query by query: right, but linear in seq_len
    blocks = keys = 0
    for i in range(seq_len):
        read = min(top_k, i // block_size + 1)
        blocks += read
        keys += i % block_size + 1 + (read - 1) * block_size
    return blocks, keys


def test_prediction_is_a_rule_checked_on_drawn_configurations(tmp_path, monkeypatch):
    import attncourse.classroom.checks.ch14 as ch14

    per_block = sum(min(8, i + 1) for i in range(64))
    keys = 64 * sum(r + 1 for r in range(64)) + 64 * 64 * sum(min(8, i + 1) - 1 for i in range(64))
    assert tiles_prediction(4096, 64, 8) == (64 * per_block, keys) == (30976, 1853440)
    for t, b, k in ((1, 1, 1), (5, 2, 9), (37, 6, 2), (100, 7, 3), (64, 8, 8)):
        assert tiles_prediction(t, b, k) == per_query_count(t, b, k)
    accepted("14-predict-tiles", tiles_prediction, tmp_path, monkeypatch)
    cases = checks.get("14-predict-tiles").make_cases()
    assert len(cases) == 4 and any(t % b for t, b, _ in (c.args for c in cases))  # a ragged last block is drawn
    assert max(t for t, _b, _k in (c.args for c in cases)) > 2 ** 30  # a count token by token cannot finish
    assert any(k >= -(-t // b) for t, b, k in (c.args for c in cases))  # and a top_k over the number of blocks

    def package(seq_len, block_size, top_k):  # the review's route (F): the gate and its counter
        from attncourse.learned_sparse import moba_gate, selected_work
        q = torch.randn(1, 1, seq_len, 4)
        w = selected_work(moba_gate(q, q, block_size, top_k), block_size, seq_len)
        return w["blocks"], w["keys"]

    def checker(*cfg):
        from attncourse.classroom import checks as c
        return next(case.expected for case in c.get("14-predict-tiles").make_cases() if case.args == cfg)

    def checker_gate(seq_len, block_size, top_k):  # a package helper that is plain integer arithmetic
        from attncourse.learned_sparse import n_blocks
        nb = n_blocks(seq_len, block_size)
        return tiles_prediction(seq_len, block_size, min(top_k, nb))

    msg, graded = refused("14-predict-tiles", package, tmp_path, monkeypatch)
    assert "called torch.randn" in msg and "called torch.randn" in graded, msg
    for route in (checker, checker_gate):
        msg, graded = refused("14-predict-tiles", route, tmp_path, monkeypatch)
        assert "called attncourse" in msg and "called attncourse" in graded, (route.__name__, msg)

    def with_tensors(seq_len, block_size, top_k):  # counting with a tensor: a tensor operation runs
        i = torch.arange(seq_len)
        read = torch.clamp(i // block_size + 1, max=top_k)
        return int(read.sum()), int((i % block_size + 1 + (read - 1) * block_size).sum())

    assert "torch" in refused("14-predict-tiles", with_tensors, tmp_path, monkeypatch)[0]

    def simulation(seq_len, block_size, top_k):  # review 8: the gate run in pure Python on random data (a
        import random  # measurement, not a prediction); here on the small cases only, as the long one never ends
        rnd = random.Random(0)
        if seq_len > 10 ** 5:
            return tiles_prediction(seq_len, block_size, top_k)
        q, k = ([rnd.gauss(0, 1) for _ in range(seq_len)] for _ in range(2))
        nb = -(-seq_len // block_size)
        means = [sum(k[b * block_size:(b + 1) * block_size]) / len(k[b * block_size:(b + 1) * block_size])
                 for b in range(nb)]
        blocks = keys = 0
        for i in range(seq_len):
            own = i // block_size
            for b in sorted(range(own), key=lambda b: -q[i] * means[b])[:top_k - 1] + [own]:
                blocks += 1
                keys += i - own * block_size + 1 if b == own else block_size
        return blocks, keys

    msg, graded = refused("14-predict-tiles", simulation, tmp_path, monkeypatch)
    assert "random" in msg and "random" in graded, msg

    def printed(seq_len, block_size, top_k):  # the exercise's numbers typed in
        return 30976, 1853440

    def whole_own_block(seq_len, block_size, top_k):  # forgets the causal own block
        blocks, _ = tiles_prediction(seq_len, block_size, top_k)
        return blocks, blocks * block_size

    def full_last_block(seq_len, block_size, top_k):  # pads the last block: right only when T is a multiple
        return tiles_prediction(-(-seq_len // block_size) * block_size, block_size, top_k)

    def top_k_always(seq_len, block_size, top_k):  # every query reads top_k blocks
        return seq_len * top_k, tiles_prediction(seq_len, block_size, top_k)[1]

    said = set()
    for route in (printed, whole_own_block, full_last_block, top_k_always):
        msg, graded = refused("14-predict-tiles", route, tmp_path, monkeypatch)
        body = msg.split("\n", 1)[1]
        assert "prediction is not right" in body and "blocks visited" not in body, (route.__name__, msg)
        said.add(body)
    assert len(said) == 1, said
    # the answer is importable from nowhere in the checks module, and the exercise notebook does not import the
    # package's counter before the verify cell
    public = [n for n in vars(ch14) if not n.startswith("_") and callable(getattr(ch14, n))
              and getattr(getattr(ch14, n), "__module__", "") == ch14.__name__]
    assert public == [], public
    nb = nbformat.read(ROOT / "exercises" / "14_learned_sparse_attention.ipynb", as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "selected_work" in cell.source:
            assert cell.source.startswith('if passed("14-predict-tiles")'), i


# ----------------------------------------------------------------------------- 4. experiment


def selection_recall(seed, top_k):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(64, 1, 256, 32, generator=gen)
    k = torch.randn(64, 1, 256, 32, generator=gen)
    needle = torch.randint(0, 240, (64,), generator=gen)
    last = q[:, 0, -1]
    k[torch.arange(64), 0, needle] += last
    scores = torch.einsum("nbd,nd->nb", k[:, 0].unflatten(1, (16, 16)).mean(2), last)  # (64, 16)
    held = needle // 16 == 15
    if top_k > 1:
        held |= (scores[:, :15].topk(min(top_k - 1, 15), -1).indices == (needle // 16)[:, None]).any(-1)
    return float(held.float().mean())


def test_recall_right_answer(tmp_path, monkeypatch):
    accepted("14-selection-recall", selection_recall, tmp_path, monkeypatch)


def test_recall_reference_copied_and_constants_refused(tmp_path, monkeypatch):
    """The check's own reference, called or pasted, goes through the package's gate: refused for calling it. The same
    measurement with the gate written by hand over every query (a learner's exercise-1 gate reused) is refused by the
    property. Hand-typed values are refused."""
    import inspect
    import textwrap

    import attncourse.classroom.checks.ch14_recall as ch14

    assert "called" in failure("14-selection-recall", ch14._selection_recall_reference)
    space = dict(vars(ch14))
    exec(textwrap.dedent(inspect.getsource(ch14._selection_recall_reference)), space)  # its source, pasted
    msg, graded = refused("14-selection-recall", space["_selection_recall_reference"], tmp_path, monkeypatch)
    assert "called" in msg and "called" in graded, msg

    def with_exercise_one_gate(seed, top_k):  # the learner's own full gate from exercise 1, every query scored
        gen = torch.Generator().manual_seed(seed)
        q, k = torch.randn(64, 1, 256, 32, generator=gen), torch.randn(64, 1, 256, 32, generator=gen)
        needle = torch.randint(0, 240, (64,), generator=gen)
        k[torch.arange(64), 0, needle] += q[:, 0, -1]
        listed = moba_select(q, k, 16, top_k)[:, 0, -1]  # (64, top_k) blocks of the last query, all 256 scored
        return float((listed == (needle // 16)[:, None]).any(-1).float().mean())

    msg, graded = refused("14-selection-recall", with_exercise_one_gate, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, msg
    cases = checks.get("14-selection-recall").make_cases()
    table = {k: sum(c.expected for c in cases if c.args[1] == k) / 3 for k in (2, 4, 8)}
    failure("14-selection-recall", lambda seed, top_k: table[top_k])  # one value per top_k, read off the cases
    failure("14-selection-recall", lambda seed, top_k: (top_k - 1) / 15)  # chance: the needle has signal


def gate_on_lists(seed, top_k):
    """Review 12b's route H, cut to the last query so the test stays fast: the draws in torch, then q and k read out
    with tolist() and the gate's dot products done on lists (the function takes no tensors, so the guard's read-out
    budget does not apply). The full gate on lists (every position, /tmp/rv12b/c9.py) reads the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(64, 1, 256, 32, generator=gen), torch.randn(64, 1, 256, 32, generator=gen)
    needle = torch.randint(0, 240, (64,), generator=gen)
    k[torch.arange(64), 0, needle] += q[:, 0, -1]
    Q, K, W = q[:, 0, -1].tolist(), k[:, 0].tolist(), needle.tolist()
    hits = 0
    for b in range(64):
        means = [[sum(col) / 16 for col in zip(*K[b][j * 16:(j + 1) * 16])] for j in range(16)]
        row = [sum(x * y for x, y in zip(Q[b], m)) for m in means]
        best = sorted(range(15), key=row.__getitem__, reverse=True)[:top_k - 1]
        hits += W[b] // 16 in set(best + [15])
    return hits / 64


def test_recall_gate_on_lists_refused(tmp_path, monkeypatch):
    """Review 12b, finding 2: the gate computed in plain Python after q.tolist(), k.tolist() passed 2/2."""
    msg, graded = refused("14-selection-recall", gate_on_lists, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, msg
    assert "plain Python" in msg, msg


# ----------------------------------------------------------------------------- the package's gate, pasted


def test_gate_package_source_and_code_object_refused(tmp_path, monkeypatch):
    """moba_gate rebuilt from its code object, or its source pasted and run against the package's helpers: refused
    (it enters the course's code). A copy with every helper inlined by hand is the learner's own code (README, "What
    the guard cannot see")."""
    import inspect
    import textwrap
    import types

    from attncourse import learned_sparse as ls

    rebuilt = types.FunctionType(ls.moba_gate.__code__, vars(ls), "moba_gate")
    space = dict(vars(ls))
    exec(textwrap.dedent(inspect.getsource(ls.moba_gate)), space)
    for route in (rebuilt, space["moba_gate"]):
        msg, graded = refused("14-moba-gate", route, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, msg


# ----------------------------------------------------------------------------- review 4's routes, each refused


def test_gate_token_scores_behind_an_inserted_dim_refused(tmp_path, monkeypatch):
    """Every query-key score as a (B, H, T, 1, T) or (B, H, T, D, T) tensor (no two adjacent dims of size T), then
    block means of the scores (equal to the query times the mean key, by linearity): refused."""
    def inserted_dim(query, key, block_size, top_k):
        h, s_len = query.shape[1], key.shape[2]
        kk = key.repeat_interleave(h // key.shape[1], dim=1)
        sc = (query.unsqueeze(-1) * kk.transpose(-2, -1).unsqueeze(2)).sum(-2, keepdim=True)  # (B,H,Tq,1,S)
        nb = -(-s_len // block_size)
        gate = torch.cat([sc[..., i * block_size:(i + 1) * block_size].mean(-1) for i in range(nb)], -1)
        return rank_blocks(gate, s_len, block_size, top_k)

    msg, graded = refused("14-moba-gate", inserted_dim, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, msg


def test_gate_short_last_block_never_decides():
    """The exercise text no longer asks for the short last block's mean: a causal gate never ranks that block (it is
    only ever its own queries' block). Shown here: a zero-padded mean gives the package's selection exactly."""
    from attncourse.learned_sparse import moba_gate
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 1, 2, 37, 8, generator=gen, dtype=torch.float64).unbind(0)
    nb = -(-37 // 6)
    padded = torch.cat([k, k.new_zeros(1, 2, nb * 6 - 37, 8)], 2).view(1, 2, nb, 6, 8).sum(3) / 6
    gate = q @ padded.transpose(-2, -1)
    own, blocks = torch.arange(37)[:, None] // 6, torch.arange(nb)[None, :]
    rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)
    assert torch.equal((rank < 1) & (blocks < own) | (blocks == own), moba_gate(q, k, 6, 2))
    text = nbformat.read(ROOT / "solutions/14_learned_sparse_attention.ipynb", 4).cells[2].source
    assert "its mean is over the keys it holds" not in text


def test_bug_dense_on_laundered_copies_refused(tmp_path, monkeypatch):
    """Dense masked attention on copies of K and V that escape read tracking (an exempt 'sum' over a singleton dim
    for K, block-sized slices concatenated for V): refused by the property, without finding the bug."""
    def laundered(q, k, v, block, top_k):
        h, t, d = q.shape
        kc = k.unsqueeze(0).sum(0)
        vc = torch.cat([v[:, i:i + block] for i in range(0, t, block)], 1)
        nb = -(-t // block)
        gate = q @ torch.stack([kc[:, i * block:(i + 1) * block].mean(1) for i in range(nb)], 1).transpose(-2, -1)
        own, blocks = torch.arange(t)[:, None] // block, torch.arange(nb)[None, :]
        rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)
        sel = (rank < top_k - 1) & (blocks < own) | (blocks == own)
        allowed = sel.repeat_interleave(block, dim=-1)[..., :t] & torch.ones(t, t, dtype=torch.bool).tril()
        s = (q @ kc.transpose(-2, -1) / math.sqrt(d)).masked_fill(~allowed, -math.inf)
        m0 = q.new_full((h, t), -math.inf)
        st = online_attention_update(AttentionState(m0, torch.zeros_like(m0), q.new_zeros(h, t, v.shape[-1])), s, vc)
        return finalize_attention_state(st)[0]

    msg, graded = refused("14-find-the-bug-1", laundered, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, msg
    assert "dense attention" in msg, msg


def _laundered_selection(q, k, block, top_k):
    """Copies of K and V that escape read tracking, and MoBA's selection (H, T, nB)."""
    h, t, d = q.shape
    kc = k.unsqueeze(0).sum(0)
    gate, nb = block_gate(q, k, block)
    own, blocks = torch.arange(t)[:, None] // block, torch.arange(nb)[None, :]
    rank = gate.masked_fill(blocks >= own, -math.inf).argsort(-1, descending=True).argsort(-1)
    return kc, (rank < top_k - 1) & (blocks < own) | (blocks == own)


def per_query_over_copies(q, k, v, block, top_k):
    """One query at a time against every earlier key of laundered copies, scores by an elementwise product (no
    tensor with two long dims), the unselected keys masked: the review's open route."""
    h, t, d = q.shape
    kc, sel = _laundered_selection(q, k, block, top_k)
    vc = torch.cat([v[:, i:i + block] for i in range(0, t, block)], 1)
    out = torch.empty(h, t, v.shape[-1], dtype=q.dtype)
    for hh in range(h):
        for i in range(t):
            s = (q[hh, i:i + 1] * kc[hh, :i + 1]).sum(-1)[None] / math.sqrt(d)  # (1, i + 1)
            keep = sel[hh, i].repeat_interleave(block)[:i + 1]
            m0 = q.new_full((1,), -math.inf)
            st = AttentionState(m0, torch.zeros_like(m0), q.new_zeros(1, v.shape[-1]))
            st = online_attention_update(st, s.masked_fill(~keep[None], -math.inf), vc[hh, :i + 1])
            out[hh, i] = finalize_attention_state(st)[0][0]
    return out


def query_tiles_over_copies(q, k, v, block, top_k):
    """A tile of `block` queries at a time against every earlier key of the copies, masked."""
    h, t, d = q.shape
    kc, sel = _laundered_selection(q, k, block, top_k)
    vc = torch.cat([v[:, i:i + block] for i in range(0, t, block)], 1)
    out = torch.empty(h, t, v.shape[-1], dtype=q.dtype)
    for hh in range(h):
        for a in range(0, t, block):
            b = min(a + block, t)
            s = (q[hh, a:b, None] * kc[hh, None, :b]).sum(-1) / math.sqrt(d)  # (Bq, b)
            keep = sel[hh, a:b].repeat_interleave(block, -1)[:, :b] & (torch.arange(b)[None] <= torch.arange(a, b)[:, None])
            m0 = q.new_full((b - a,), -math.inf)
            st = AttentionState(m0, torch.zeros_like(m0), q.new_zeros(b - a, v.shape[-1]))
            st = online_attention_update(st, s.masked_fill(~keep, -math.inf), vc[hh, :b])
            out[hh, a:b] = finalize_attention_state(st)[0]
    return out


def gathered_selection(q, k, v, block, top_k):
    """A right answer laid out differently: per query, its selected blocks gathered, then one update."""
    h, t, d = q.shape
    gate, _ = block_gate(q, k, block)
    out = torch.empty(h, t, v.shape[-1], dtype=q.dtype)
    for hh in range(h):
        for i in range(t):
            own = i // block
            chosen = [own]
            if top_k > 1 and own > 0:
                chosen += gate[hh, i, :own].topk(min(top_k - 1, own)).indices.tolist()
            idx = [j for b in sorted(chosen) for j in range(b * block, min((b + 1) * block, i + 1))]
            kk = torch.cat([k[hh, j:j + 1] for j in idx])
            vv = torch.cat([v[hh, j:j + 1] for j in idx])
            s = (q[hh, i:i + 1] @ kk.transpose(-2, -1)) / math.sqrt(d)
            m0 = q.new_full((1,), -math.inf)
            st = online_attention_update(AttentionState(m0, torch.zeros_like(m0), q.new_zeros(1, v.shape[-1])), s, vv)
            out[hh, i] = finalize_attention_state(st)[0][0]
    return out


def test_bug_work_follows_the_selection_whatever_the_copies(tmp_path, monkeypatch):
    """Loops over laundered copies of K and V, a query or a tile of queries at a time, with no tensor of two long dims:
    refused because the entries their operators take in follow every earlier key, not the selection. A right answer
    laid out differently (each query's selected blocks gathered) passes."""
    msg = failure("14-find-the-bug-1", as_learner(gathered_selection))  # passes the reads, then judged as an edit
    assert "token by token" in msg and "tensor entries" not in msg, msg
    msg, graded = refused("14-find-the-bug-1", per_query_over_copies, tmp_path, monkeypatch)  # check and grader
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, msg
    assert "tensor entries" in msg and "T=128" in msg, msg
    msg = failure("14-find-the-bug-1", as_learner(query_tiles_over_copies))  # the check cell (the same property)
    assert NOT_THE_WAY in msg and "tensor entries" in msg and "T=128" in msg, msg


def test_recall_every_query_behind_an_inserted_dim_refused(tmp_path, monkeypatch):
    """The whole gate for all 256 queries as (n, 256, 1, 16), then the last row kept: refused."""
    def inserted_dim(seed, top_k):
        n, t, d, block = 64, 256, 32, 16
        gen = torch.Generator().manual_seed(seed)
        q, k = torch.randn(n, 1, t, d, generator=gen), torch.randn(n, 1, t, d, generator=gen)
        pos, rows = torch.randint(0, t - block, (n,), generator=gen), torch.arange(n)
        k[rows, 0, pos] += q[:, 0, -1]
        means = k[:, 0].view(n, t // block, block, d).mean(2)
        gate = (q[:, 0].unsqueeze(-1) * means.transpose(1, 2).unsqueeze(1)).sum(2, keepdim=True)[:, -1]
        own, blocks = torch.arange(t)[:, None] // block, torch.arange(t // block)[None, :]
        rank = gate.masked_fill(blocks >= own[-1:], -math.inf).argsort(-1, descending=True).argsort(-1)
        sel = ((rank < top_k - 1) & (blocks < own[-1:]) | (blocks == own[-1:]))[:, 0]
        return float(sel[rows, pos // block].float().mean())

    msg, graded = refused("14-selection-recall", inserted_dim, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded, msg


def test_gate_every_score_one_query_row_at_a_time_refused(tmp_path, monkeypatch):
    """Review 6: each query against every key, one row at a time, then block means. No tensor is T x T, but the
    work is: the bound on the total entries taken in refuses it. The route is the exercise's breaker, run as learner
    code by `refused`."""
    from attncourse.classroom.checks.ch14_breakers import _breaker_row_scores

    msg, graded = refused("14-moba-gate", _breaker_row_scores, tmp_path, monkeypatch)
    assert "entries in all" in msg and "entries in all" in graded, msg


def test_bug_dense_in_plain_python_refused(tmp_path, monkeypatch):
    """Review 6: dense masked attention on .tolist() lists (every key scored for every query, one softmax, no block
    loop) passed 2/2; the property now asks that the products take in at least the entries of q, k and v."""
    def plain(q, k, v, block_size, top_k):
        h, t, d = q.shape
        Q, K, V = q.tolist(), k.tolist(), v.tolist()
        nb = -(-t // block_size)
        out = []
        for hh in range(h):
            means = [[sum(K[hh][s][c] for s in range(b * block_size, min((b + 1) * block_size, t)))
                      / (min((b + 1) * block_size, t) - b * block_size) for c in range(d)] for b in range(nb)]
            rows = []
            for i in range(t):
                own = i // block_size
                best = sorted(range(own), key=lambda b: -sum(Q[hh][i][c] * means[b][c] for c in range(d)))
                chosen = set(best[:top_k - 1]) | {own}
                sc = [sum(Q[hh][i][c] * K[hh][s][c] for c in range(d)) / math.sqrt(d)
                      if s // block_size in chosen and s <= i else -math.inf for s in range(t)]
                m = max(sc)
                w = [math.exp(x - m) for x in sc]
                z = sum(w)
                rows.append([sum(w[s] * V[hh][s][j] for s in range(t)) / z for j in range(len(V[hh][0]))])
            out.append(rows)
        return torch.tensor(out, dtype=q.dtype)

    msg, graded = refused("14-find-the-bug-1", plain, tmp_path, monkeypatch)
    assert all(("multiplied only" in m or "numbers read out of tensors" in m) for m in (msg, graded)), msg  # the
    # property or the guard's budget on numbers read out into plain Python, whichever sees it first


def test_recall_every_query_reshaped_refused_by_its_work(tmp_path, monkeypatch):
    """Review 8: the whole gate for all 256 positions, reshaped so that no operand shows 256 or 256 x 16
    ((512, 32, 32) @ (512, 32, 16)), then the last row kept: the shapes pass, the multiply-adds do not."""
    def reshaped(seed, top_k):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(64, 1, 256, 32, generator=gen)
        k = torch.randn(64, 1, 256, 32, generator=gen)
        pos = torch.randint(0, 240, (64,), generator=gen)
        k[torch.arange(64), 0, pos] += q[:, 0, -1]
        means = k[:, 0].reshape(64, 16, 16, 32).mean(2)  # (64, 16, 32)
        gate = (q[:, 0].reshape(512, 32, 32) @ means.repeat_interleave(8, 0).transpose(-2, -1)).reshape(64, 8, 32, 16)
        last = gate[:, -1, -1]  # (64, 16): every position scored, the last one kept
        held = pos // 16 == 15
        if top_k > 1:
            held = held | (last[:, :15].topk(min(top_k - 1, 15), -1).indices == (pos // 16)[:, None]).any(-1)
        return float(held.float().mean())

    msg, graded = refused("14-selection-recall", reshaped, tmp_path, monkeypatch)
    assert NOT_THE_WAY in msg and NOT_THE_WAY in graded and "multiply-adds" in msg, msg
