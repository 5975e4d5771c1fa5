"""Chapter 07's checks can fail: wrong answers of the kinds a learner writes are refused, for the right reason,
and right answers written without the forbidden functions pass."""

from __future__ import annotations

import math
import time

import pytest
import torch

from attncourse import KVCache, MultiHeadAttention, SinkWindowCache, sinusoidal_positions
from attncourse.classroom import checks
from attncourse.classroom.grading.remote import judge
from test_exercise_standard import as_learner, grader_reply


from exercise_routes import NOT_THE_WAY, accepted, failure  # noqa: E402,F401
from exercise_routes import refused as _refused  # noqa: E402


def refused(exercise_id, answer, tmp_path, monkeypatch):
    return _refused(exercise_id, answer, tmp_path, monkeypatch, statuses=("failed",))


# ----------------------------------------------------------------------------- every shortcut and breaker, both paths


# The breakers (right outputs computed the wrong way) are run by check and grader for every chapter in
# test_exercise_standard.test_properties_refuse_their_breakers; here the shortcuts of every category.
@pytest.mark.parametrize("ex", [e for e in checks.exercises_for("07") if e.shortcuts], ids=lambda e: e.id)
def test_shortcuts_refused_by_check_and_grader(ex, tmp_path, monkeypatch):
    for shortcut in ex.shortcuts:
        msg, graded = refused(ex.id, shortcut, tmp_path, monkeypatch)
        assert "called" in msg and "called" in graded, (shortcut.__name__, msg)


# ----------------------------------------------------------------------------- 1. cache mask


def cache_mask(q_len, k_len, window=None):
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    k_pos = torch.arange(k_len)[None, :]
    keep = k_pos <= q_pos
    return keep if window is None else keep & (q_pos - k_pos < window)


def test_cache_mask_right_and_wrong():
    checks.check("07-cache-mask", cache_mask)
    top_left = lambda q, k, w=None: cache_mask(k, k, w)[:q]  # noqa: E731 - queries at 0..Tq-1
    assert "called" not in failure("07-cache-mask", top_left)
    no_window = lambda q, k, w=None: cache_mask(q, k)  # noqa: E731
    assert "window=3" in failure("07-cache-mask", no_window)
    off_by_one = lambda q, k, w=None: cache_mask(q, k, None if w is None else w + 1)  # noqa: E731
    assert "called" not in failure("07-cache-mask", off_by_one)


def test_cache_mask_every_triangle_spelling_refused():
    """The triangle is refused however it is reached: the ATen operator, a method looked up by name, numpy."""
    import numpy as np

    def aten_default(q, k, w=None):
        keep = torch.ops.aten.tril.default(torch.ones(q, k, dtype=torch.bool), k - q)
        return keep if w is None else keep & ~torch.ops.aten.tril.default(torch.ones(q, k, dtype=torch.bool), k - q - w)

    def by_getattr(q, k, w=None):
        ones = torch.ones(q, k, dtype=torch.bool)
        keep = getattr(ones, "tr" + "il")(k - q)
        return keep if w is None else keep & ~getattr(ones, "tr" + "il")(k - q - w)

    def triu_negated(q, k, w=None):
        ones = torch.ones(q, k, dtype=torch.bool)
        keep = ~torch.ops.aten.triu(ones, k - q + 1)
        return keep if w is None else keep & torch.ops.aten.triu(ones, k - q - w + 1)

    def numpy_tri(q, k, w=None):
        keep = np.tri(q, k, k - q, dtype=bool)
        return torch.from_numpy(keep if w is None else keep & ~np.tri(q, k, k - q - w, dtype=bool))

    def numpy_import(q, k, w=None):
        tril = getattr(__import__("numpy"), "tr" + "il")
        ones = np.ones((q, k), dtype=bool)
        keep = tril(ones, k - q)
        return torch.from_numpy(keep if w is None else keep & ~tril(ones, k - q - w))

    def in_place(q, k, w=None):  # review 8: Tensor.tril_ passed (2/2 in the grader)
        keep = torch.ones(q, k, dtype=torch.bool).tril_(k - q)
        return keep if w is None else keep & ~torch.ones(q, k, dtype=torch.bool).tril_(k - q - w)

    def in_place_triu(q, k, w=None):
        keep = ~torch.ones(q, k, dtype=torch.bool).triu_(k - q + 1)
        return keep if w is None else keep & torch.ones(q, k, dtype=torch.bool).triu_(k - q - w + 1)

    def eye_cumsum(q, k, w=None):  # review 11: the triangle as a running sum of an identity passed
        tri = torch.eye(k, dtype=torch.long).cumsum(0).bool()                  # (Tk, Tk) lower triangle
        keep = tri[k - q:]
        if w is None:
            return keep
        far = torch.cat([torch.zeros(w, k, dtype=torch.long), torch.eye(k, dtype=torch.long)])[:k].cumsum(0).bool()
        return keep & ~far[k - q:]

    def eye_cummax(q, k, w=None):  # a running maximum draws it too
        shifted = lambda s: torch.cat([torch.zeros(s, k), torch.eye(k)])[:k].cummax(0).values.bool()  # noqa: E731
        keep = shifted(0)[k - q:]
        return keep if w is None else keep & ~shifted(w)[k - q:]

    def in_place_cumsum(q, k, w=None):
        def shifted(s):
            tri = torch.cat([torch.zeros(s, k, dtype=torch.long), torch.eye(k, dtype=torch.long)])[:k]
            tri.cumsum_(0)
            return tri.bool()
        keep = shifted(0)[k - q:]
        return keep if w is None else keep & ~shifted(w)[k - q:]

    for answer in (aten_default, by_getattr, triu_negated, numpy_tri, numpy_import, in_place, in_place_triu,
                   eye_cumsum, eye_cummax, in_place_cumsum):
        assert "called" in failure("07-cache-mask", answer), answer.__name__


# ----------------------------------------------------------------------------- 2. cache update


def cache_update(buf_k, buf_v, length, k_new, v_new):
    end = length + k_new.shape[2]
    buf_k[:, :, length:end] = k_new
    buf_v[:, :, length:end] = v_new
    return buf_k[:, :, :end], buf_v[:, :, :end]


def test_cache_update_right_and_wrong(tmp_path, monkeypatch):
    accepted("07-cache-update", cache_update, tmp_path, monkeypatch)

    def forgets_old(buf_k, buf_v, length, k_new, v_new):
        return k_new, v_new

    failure("07-cache-update", forgets_old)

    def whole_buffer(buf_k, buf_v, length, k_new, v_new):
        cache_update(buf_k, buf_v, length, k_new, v_new)
        return buf_k, buf_v

    failure("07-cache-update", whole_buffer)

    def fresh_tensors(buf_k, buf_v, length, k_new, v_new):  # right values, the buffers untouched, no torch.cat
        out = []
        for buf, new in ((buf_k, k_new), (buf_v, v_new)):
            t = torch.zeros(*buf.shape[:2], length + new.shape[2], buf.shape[3], dtype=buf.dtype)
            t[:, :, :length] = buf[:, :, :length]
            t[:, :, length:] = new
            out.append(t)
        return tuple(out)

    for msg in refused("07-cache-update", fresh_tensors, tmp_path, monkeypatch):
        assert "not the way" in msg

    def written_then_copied(buf_k, buf_v, length, k_new, v_new):  # in place, but hands back copies
        return tuple(t.clone() for t in cache_update(buf_k, buf_v, length, k_new, v_new))

    for msg in refused("07-cache-update", written_then_copied, tmp_path, monkeypatch):
        assert "copies" in msg

    def written_then_times_one(buf_k, buf_v, length, k_new, v_new):  # the cold review's route 07-a: k * 1, v + 0
        keys, values = cache_update(buf_k, buf_v, length, k_new, v_new)
        return keys * 1, values + 0

    for msg in refused("07-cache-update", written_then_times_one, tmp_path, monkeypatch):
        assert "copies" in msg



# ----------------------------------------------------------------------------- 3. decode bug


def decode(state, x, n_sink, window, *, fixed):
    b, t, d = x.shape
    mha = MultiHeadAttention(d, 4)
    mha.load_state_dict(state)
    cache = SinkWindowCache(b, 4, d // 4, window=window, n_sink=n_sink)
    pe = sinusoidal_positions(max(t, 64), d)
    outs = []
    with torch.no_grad():
        for i in range(t):
            pos = i if fixed else len(cache)  # the exercise's bug: the live keys, not the tokens seen
            outs.append(mha(x[:, i:i + 1] + pe[pos], kv_cache=cache))
    return torch.cat(outs, dim=1)


def fixed_decode(line_fix, step=None):
    """The given decode_buggy with its loop line edited, typed in a cell (the edit judge reads its source)."""
    from attncourse.classroom.checks.ch07 import BUGGY_DECODE
    from test_edits import cell_function

    source = BUGGY_DECODE.replace("decode_step(mha, x[:, t:t + 1], cache)", line_fix).replace("_buggy(", "_fixed(")
    ns = {"torch": torch, "MultiHeadAttention": MultiHeadAttention, "SinkWindowCache": SinkWindowCache,
          "PE": sinusoidal_positions(512, 16), "decode_step": step}
    return cell_function(source, "decode_fixed", ns)


def test_decode_bug_fixed_passes_and_buggy_fails(tmp_path, monkeypatch):
    accepted("07-find-the-bug-1", fixed_decode("mha(x[:, t:t + 1] + PE[t], kv_cache=cache)"), tmp_path, monkeypatch)
    accepted("07-find-the-bug-1", fixed_decode("mha(x[:, t:t + 1] + PE[cache.seen], kv_cache=cache)"), tmp_path,
             monkeypatch)  # the cache's own count of tokens seen: also right
    # the helper redefined right and decode_fixed byte-identical to the given decode (review 11): the fix is in
    # code the edit judge does not read, so it is refused, as ch08's "calls no code written elsewhere"
    step = lambda mha, x_new, cache: mha(x_new + sinusoidal_positions(512, 16)[cache.seen], kv_cache=cache)  # noqa
    msg, graded = refused("07-find-the-bug-1", fixed_decode("decode_step(mha, x[:, t:t + 1], cache)", step), tmp_path,
                          monkeypatch)
    assert "written elsewhere" in msg and "written elsewhere" in graded
    checks.check("07-decode-bug", fixed_decode("mha(x[:, t:t + 1] + PE[t], kv_cache=cache)"))  # the earlier id
    msg, _ = refused("07-find-the-bug-1", lambda s, x, n, w: decode(s, x, n, w, fixed=True), tmp_path, monkeypatch)
    assert "not the way" in msg  # right values written afresh: not an edit of the given decode
    msg = failure("07-find-the-bug-1", lambda s, x, n, w: decode(s, x, n, w, fixed=False))
    assert "B=" in msg and "called" not in msg
    # the buggy code is right on a stream that never evicts (the first case): only longer streams show it
    case = checks.get("07-find-the-bug-1").make_cases()[0]
    state, x, n_sink, window = case.args
    assert x.shape[1] <= n_sink + window
    torch.testing.assert_close(decode(*case.args, fixed=False), case.expected, rtol=1e-4, atol=1e-5)



def _keep(t, n_sink, window):
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    return (j <= i) & ((j < n_sink) | (i - j < window))


def full_forward(state, x, n_sink, window):  # the review's route: no decode, no cache
    mha = MultiHeadAttention(16, 4)
    mha.load_state_dict(state)
    with torch.no_grad():
        return mha(x + sinusoidal_positions(x.shape[1], 16), attn_mask=_keep(x.shape[1], n_sink, window))


def prefix_recompute(state, x, n_sink, window):  # token by token, but every step runs the whole prefix again
    mha = MultiHeadAttention(16, 4)
    mha.load_state_dict(state)
    pe = sinusoidal_positions(x.shape[1], 16)
    with torch.no_grad():
        return torch.cat([mha(x[:, :i + 1] + pe[:i + 1], attn_mask=_keep(i + 1, n_sink, window))[:, -1:]
                          for i in range(x.shape[1])], dim=1)


def by_hand_with_sdpa(state, x, n_sink, window):  # the weights by hand and PyTorch's fused attention
    b, t, d = x.shape
    h = x + sinusoidal_positions(t, d)
    q, k, v = (torch.nn.functional.linear(h, state[f"{n}_proj.weight"]).view(b, t, 4, 4).transpose(1, 2)
               for n in "qkv")
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_keep(t, n_sink, window))
    return torch.nn.functional.linear(o.transpose(1, 2).reshape(b, t, d), state["o_proj.weight"])


def by_hand_matmul(state, x, n_sink, window):  # the weights by hand, a plain softmax, every position at once
    b, t, d = x.shape
    h = x + sinusoidal_positions(t, d)
    q, k, v = ((h @ state[f"{n}_proj.weight"].T).view(b, t, 4, 4).transpose(1, 2) for n in "qkv")
    s = (q @ k.transpose(-2, -1) / 2.0).masked_fill(~_keep(t, n_sink, window), -math.inf)
    o = torch.softmax(s, dim=-1) @ v
    return o.transpose(1, 2).reshape(b, t, d) @ state["o_proj.weight"].T


def growing_cache_with_mask(state, x, n_sink, window):  # a KVCache and the mask per step: memory O(T), refused
    b, t, d = x.shape
    mha = MultiHeadAttention(d, 4)
    mha.load_state_dict(state)
    cache = KVCache(b, 4, d // 4, capacity=t)
    pe = sinusoidal_positions(t, d)
    with torch.no_grad():
        return torch.cat([mha(x[:, i:i + 1] + pe[i], kv_cache=cache, attn_mask=_keep(i + 1, n_sink, window)[-1:])
                          for i in range(t)], dim=1)


@pytest.mark.parametrize("route", [full_forward, prefix_recompute, by_hand_with_sdpa, by_hand_matmul])
def test_decode_bug_routes_without_decoding_are_refused(route, tmp_path, monkeypatch):
    case = checks.get("07-find-the-bug-1").make_cases()[1]
    torch.testing.assert_close(route(*case.args), case.expected, rtol=1e-4, atol=1e-5)
    msg, graded = refused("07-find-the-bug-1", route, tmp_path, monkeypatch)
    assert ("tokens of each sequence" in msg or "called" in msg) and "position" not in msg.split("hint")[0]


def unbounded_cache_buggy_line_kept(state, x, n_sink, window):  # review 6 (b07.py): the bug left in, the cache
    b, t, d = x.shape                                                # swapped for an unbounded one: len(cache) grows
    mha = MultiHeadAttention(d, 4)
    mha.load_state_dict(state)
    cache = KVCache(b, 4, d // 4, capacity=t)
    pe = sinusoidal_positions(max(t, 64), d)
    outs = []
    with torch.no_grad():
        for i in range(t):
            j = torch.arange(i + 1)[None, :]
            outs.append(mha(x[:, i:i + 1] + pe[len(cache)], attn_mask=(j < n_sink) | (i - j < window), kv_cache=cache))
    return torch.cat(outs, dim=1)


def own_growing_list(state, x, n_sink, window):  # the keys and values in a growing tensor of its own, masked
    b, t, d = x.shape
    pe = sinusoidal_positions(t, d)
    w = {n: state[f"{n}_proj.weight"] for n in "qkvo"}
    ks = vs = None
    outs = []
    for i in range(t):
        h = x[:, i:i + 1] + pe[i]
        q, k, v = ((h @ w[n].T).view(b, 1, 4, 4).transpose(1, 2) for n in "qkv")
        ks = k if ks is None else torch.cat([ks, k], dim=2)
        vs = v if vs is None else torch.cat([vs, v], dim=2)
        j = torch.arange(i + 1)
        s = (q @ ks.transpose(-2, -1) / 2.0).masked_fill(~((j < n_sink) | (i - j < window)), -math.inf)
        p = torch.exp(s - s.amax(-1, keepdim=True))
        o = (p / p.sum(-1, keepdim=True)) @ vs
        outs.append(o.transpose(1, 2).reshape(b, 1, d) @ w["o"].T)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("route", [growing_cache_with_mask, unbounded_cache_buggy_line_kept, own_growing_list])
def test_decode_bug_unbounded_memory_refused(route, tmp_path, monkeypatch):
    case = checks.get("07-find-the-bug-1").make_cases()[1]
    torch.testing.assert_close(route(*case.args), case.expected, rtol=1e-4, atol=1e-5)
    msg, graded = refused("07-find-the-bug-1", route, tmp_path, monkeypatch)
    assert "positions per head" in msg and NOT_THE_WAY in graded


# ----------------------------------------------------------------------------- 4. eviction


def keep(positions, n_sink, window):
    return (positions < n_sink) | (positions.max() + 1 - positions < window)


def test_sink_eviction_right_and_wrong():
    checks.check("07-sink-eviction", keep)
    failure("07-sink-eviction", lambda p, s, w: p.max() + 1 - p < w)  # forgets the sinks
    failure("07-sink-eviction", lambda p, s, w: (p < s) | (p.max() - p < w))  # keeps one key too many


# ----------------------------------------------------------------------------- 5. predict


def test_prediction_verify_cell_waits_for_a_pass():
    import nbformat

    from attncourse.classroom.nbtools import ROOT

    nb = nbformat.read(ROOT / "exercises" / "07_causal_masks_kv_cache.ipynb", as_version=4)
    verify = [c for c in nb.cells if c.cell_type == "code" and "SinkWindowCache(1, 1, 2, window=4, n_sink=8)" in c.source]
    assert verify and all(c.source.startswith('if passed("07-predict-sizes")') for c in verify)


def test_bug_words_stay_out_of_the_exercise_notebook():
    import re

    import nbformat

    from attncourse.classroom.nbtools import ROOT

    nb = nbformat.read(ROOT / "exercises" / "07_causal_masks_kv_cache.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    ex = checks.get("07-find-the-bug-1")
    assert ex.id.startswith("07-find-the-bug") and "07-decode-bug" in ex.aliases
    for word in ex.bug_words:
        assert not re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}", text, flags=re.IGNORECASE), word


def predicted_sizes(cache, sink_cache, mask):
    batch, n_kv_heads, head_dim, capacity, nbytes = cache
    window, n_sink, n_tokens = sink_cache
    q_len, k_len, w = mask
    # pairs at distance t = i - j in [0, min(w, q_len)): min(k_len, q_len - t) of them
    full = max(0, min(w, q_len, q_len - k_len + 1))  # distances at which every key has its query
    top = min(w, q_len)
    pairs = full * k_len + (top - full) * q_len - (top * (top - 1) - full * (full - 1)) // 2
    return 2 * batch * n_kv_heads * capacity * head_dim * nbytes, min(n_tokens, n_sink + window - 1), pairs


def test_predicted_sizes_closed_form_matches_rows():  # the test's rule against a row-by-row count, small sizes
    for q_len in range(1, 14):
        for k_len in range(1, 14):
            for w in range(1, 16):
                rows = sum(max(0, min(i, k_len - 1) - max(0, i - w + 1) + 1) for i in range(q_len))
                assert predicted_sizes((1, 1, 1, 1, 2), (1, 0, 1), (q_len, k_len, w))[2] == rows


def test_prediction_is_a_rule_the_package_cannot_answer(tmp_path, monkeypatch):
    from test_salting import SALT, _grader as salted_grader

    accepted("07-predict-sizes", predicted_sizes, tmp_path, monkeypatch)
    ex = checks.get("07-predict-sizes")
    assert salted_grader(ex, predicted_sizes, SALT, tmp_path, monkeypatch)[0] == "passed"
    cases = ex.make_cases()
    assert len(cases) >= 4  # the printed configuration, drawn ones, and a long context
    long_cache, long_sink, long_mask = cases[-1].args  # no simulation can finish on it
    assert long_cache[3] > 2 ** 31 and long_sink[2] > 2 ** 40 and min(long_mask) > 2 ** 28

    def package(cache, sink_cache, mask):  # the review's route: the package measures each count
        from attncourse import KVCache, SinkWindowCache, masks
        b, h, d, capacity, nbytes = cache
        ring = SinkWindowCache(1, 1, 1, window=sink_cache[0], n_sink=sink_cache[1])
        for _ in range(sink_cache[2]):
            ring.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
        return (KVCache(b, h, d, capacity, dtype=torch.bfloat16 if nbytes == 2 else torch.float32).nbytes, len(ring),
                int(masks.materialize(masks.sliding_window(mask[2]), mask[0], mask[1]).sum()))

    def checker_reference(cache, sink_cache, mask):
        from attncourse.classroom.checks.ch07_predict import predicted_sizes_reference
        return predicted_sizes_reference(cache, sink_cache, mask)

    def by_torch(cache, sink_cache, mask):  # the mask's pairs counted with tensors
        q_len, k_len, w = mask
        i, j = torch.arange(q_len)[:, None], torch.arange(k_len)[None, :]
        return predicted_sizes(cache, sink_cache, mask)[:2] + (int(((j <= i) & (i - j < w)).sum()),)

    for route in (package, checker_reference, by_torch):
        msg, graded = refused("07-predict-sizes", route, tmp_path, monkeypatch)
        assert "called" in msg or "operator" in msg, (route.__name__, msg)

    printed = predicted_sizes(*ex.make_cases()[0].args)

    def typed(cache, sink_cache, mask):  # the printed configuration's counts, typed in
        return printed

    def no_eviction(cache, sink_cache, mask):  # a cache that never evicts
        return predicted_sizes(cache, sink_cache, mask)[0], sink_cache[2], predicted_sizes(cache, sink_cache, mask)[2]

    def bottom_right(cache, sink_cache, mask):  # the window counted as if the queries were the last ones
        q_len, k_len, w = mask
        pairs = sum(min(w, p + 1) for p in range(k_len - q_len, k_len)) if q_len <= min(k_len, 10 ** 5) else -1
        return predicted_sizes(cache, sink_cache, mask)[:2] + (pairs,)

    def simulated(cache, sink_cache, mask):  # the review's route: a stream and a mask simulated, within a budget
        window, n_sink, n_tokens = sink_cache
        kept = []
        for t in range(min(n_tokens, 10 ** 5)):  # the long stream cannot be run to its end
            kept = [p for p in kept + [t] if p < n_sink or p > t - window]
        q_len, k_len, w = mask
        pairs = sum(1 for i in range(min(q_len, 300)) for j in range(min(k_len, 300)) if 0 <= i - j < w)
        return predicted_sizes(cache, sink_cache, mask)[0], len(kept), pairs

    for wrong in (typed, no_eviction, bottom_right, simulated):
        msg = failure("07-predict-sizes", wrong)
        assert "prediction is not right" in msg, (wrong.__name__, msg)
        for value in printed:
            assert f" {value}" not in msg.split("\n", 1)[1].replace(str(ex.make_cases()[0].name), "")


# ----------------------------------------------------------------------------- 6. experiment


def dropped_mass(q, k, window, slope):
    seq_len = q.shape[0]
    dist = torch.arange(seq_len)[:, None] - torch.arange(seq_len)[None, :]
    p = torch.softmax((q @ k.T / 4.0 - slope * dist).masked_fill(dist < 0, -math.inf), dim=-1)
    return p[dist >= window].sum().item() / seq_len


def test_dropped_mass_right_and_wrong():
    checks.check("07-window-dropped-mass", dropped_mass)
    failure("07-window-dropped-mass", lambda q, k, w, m: dropped_mass(q, k, w + 1, m))  # keeps one key too many
    failure("07-window-dropped-mass", lambda q, k, w, m: dropped_mass(q, k, w, -m))  # bias sign flipped
    failure("07-window-dropped-mass", lambda q, k, w, m: dropped_mass(k, q, w, m))  # queries and keys swapped


def test_dropped_mass_reference_and_closed_forms_refused():
    from attncourse.classroom.checks.ch07 import window_dropped_mass

    assert "called" in failure("07-window-dropped-mass", window_dropped_mass)
    # a closed form for uniform attention over the causal prefix, which ignores the scores
    failure("07-window-dropped-mass", lambda q, k, w, m: sum(max(i + 1 - w, 0) / (i + 1) for i in range(q.shape[0])) / q.shape[0])


def test_dropped_mass_reference_transcribed_refused():
    """The reference is built from the course's attention, ALiBi bias and masks: a transcription of it (names
    changed) enters course code and is refused (review 11 asked that an edited copy of a reference not pass)."""
    from attncourse import masks, scaled_dot_product_attention
    from attncourse.positions import alibi_bias_at

    def transcribed(q, k, w, m):
        t = torch.arange(len(q))
        b = alibi_bias_at(torch.tensor([m], dtype=q.dtype), t, t)[0]
        keep = masks.materialize(masks.causal, len(q), len(q))
        p = scaled_dot_product_attention(q, k, q, b.masked_fill(~keep, -math.inf), return_weights=True)[1]
        return p.masked_fill(masks.materialize(masks.sliding_window(w), len(q), len(q)), 0).sum(-1).mean().item()

    assert "called" in failure("07-window-dropped-mass", transcribed)


# ----------------------------------------------------------------------------- 6b. the study, graded


def _dropped(q, k, window, slope):
    t, d = q.shape
    dist = torch.arange(t)[:, None] - torch.arange(t)[None, :]
    probs = torch.softmax((q @ k.T / math.sqrt(d) - slope * dist).masked_fill(dist < 0, float("-inf")), dim=-1)
    return probs[dist >= window].sum().item() / t


def dropped_mass_study(seq_len, slopes, windows, seeds):
    qk = {s: torch.randn(2, seq_len, 16, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds}
    table = torch.tensor([[[_dropped(*qk[s], w, m) for w in windows] for s in seeds] for m in slopes],
                         dtype=torch.float64)
    return table, table.mean(1)


def float32_draw(seq_len, slopes, windows, seeds):
    """Draws in float32 (another random stream): not the draw the exercise states."""
    qk = {s: torch.randn(2, seq_len, 16, generator=torch.Generator().manual_seed(s)).double() for s in seeds}
    table = torch.tensor([[[_dropped(*qk[s], w, m) for w in windows] for s in seeds] for m in slopes],
                         dtype=torch.float64)
    return table, table.mean(1)


def test_dropped_mass_study_judges_the_measurement(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch07 import dropped_mass_study_reference

    accepted("07-window-dropped-study", dropped_mass_study, tmp_path, monkeypatch)
    typed = dropped_mass_study_reference(64, (0.25, 0.0625), (4, 16), (0, 1, 2))  # one design's numbers, typed in
    msg, _ = refused("07-window-dropped-study", lambda t, m, w, s: typed, tmp_path, monkeypatch)
    assert "shape" in msg and "called" not in msg
    msg, _ = refused("07-window-dropped-study", float32_draw, tmp_path, monkeypatch)
    assert "draw q and k exactly" in msg, msg


def test_prediction_check_stops_a_simulation_and_says_why(monkeypatch):
    """Review 10: a loop over the long case's tokens kept the in-notebook check busy with no message; each case now
    stops after its time limit (1 s here, to keep the test fast) with a reason."""
    from attncourse.classroom.checks import limits

    monkeypatch.setitem(limits.SECONDS, "07-predict-sizes", 1)

    def streamed(cache, sink_cache, mask):  # counts the sink cache by streaming every token: cannot finish on 2^40
        kept = 0
        for _ in range(sink_cache[2]):
            kept = min(kept + 1, sink_cache[1] + sink_cache[0] - 1)
        return predicted_sizes(cache, sink_cache, mask)[0], kept, predicted_sizes(cache, sink_cache, mask)[2]

    start = time.monotonic()
    with pytest.raises(checks.CheckFailed, match="more than 1 s .* closed form"):
        checks.check("07-predict-sizes", streamed)
    assert time.monotonic() - start < 30
    with limits.time_limit("07-predict-sizes"):  # the timer is off again after the case
        time.sleep(0.01)
    checks.check("07-predict-sizes", predicted_sizes)  # the closed form passes within the limit
