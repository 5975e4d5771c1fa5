"""Chapter 02's checks refuse the buggy code the exercises hand out, and accept independent right answers."""

import pytest
import torch

from attncourse import scaled_dot_product_attention
from attncourse.classroom import checks
from attncourse.classroom.checks.ch02 import BUGGY_LUONG
from test_edits import cell_function


def _buggy(query, keys, values, lengths):  # the exercise's code: each row keeps its last lengths[b] positions
    T = keys.shape[1]
    mask = torch.arange(T) >= T - lengths[:, None]
    return scaled_dot_product_attention(query.unsqueeze(1), keys, values, mask.unsqueeze(1), scale=1.0).squeeze(1)


def _from_scratch(query, keys, values, lengths):  # right values, written anew: not a diagnosis
    valid = torch.arange(keys.shape[1]) < lengths[:, None]  # (B, T)
    scores = torch.einsum("bd,btd->bt", query, keys).masked_fill(~valid, float("-inf"))
    return torch.einsum("bt,btv->bv", torch.softmax(scores, dim=-1), values)


# the given function with its mask read the right way, typed in a cell (the check reads its source)
_fixed = cell_function(BUGGY_LUONG.replace(">= T - lengths", "< lengths").replace("_buggy(", "("),
                       "luong_dot_attention", {"torch": torch})


def test_the_bug_fails_and_the_fix_passes(capsys):
    with pytest.raises(checks.CheckFailed, match="02-find-the-bug"):
        checks.check("02-find-the-bug", _buggy)
    with pytest.raises(checks.CheckFailed, match="not the way"):
        checks.check("02-find-the-bug", _from_scratch)
    checks.check("02-find-the-bug", _fixed)
    assert "✓ 02-find-the-bug" in capsys.readouterr().out


def test_no_one_token_flip_fixes_the_bug():
    """Cold review 15 passed the earlier version of this exercise (the mask's sense flipped) with a blind search over
    the 12 edits {>=, >, <=, <, ==, !=} x {~mask, mask} in 2 calls. None of those 12 edits fixes the given function
    now (so such a search only spends the check's tries); the fix needs the cause: which end of a row is padding."""
    import itertools

    from attncourse.classroom.checks.ch02 import reference_dot_attention

    cases = checks.get("02-find-the-bug").make_cases()
    right = 0
    for op, sense in itertools.product((">=", ">", "<=", "<", "==", "!="), ("~mask", "mask")):
        source = BUGGY_LUONG.replace(">= T", f"{op} T").replace("~mask", sense).replace("_buggy(", "(")
        candidate = cell_function(source, "luong_dot_attention", {"torch": torch})
        right += all(torch.allclose(candidate(*c.args), reference_dot_attention(*c.args), equal_nan=False)
                     for c in cases)
    assert right == 0
    assert all(torch.allclose(_fixed(*c.args), reference_dot_attention(*c.args)) for c in cases)


def test_the_scaled_score_is_refused_as_wrong():
    def scaled(query, keys, values, lengths):
        valid = torch.arange(keys.shape[1]) < lengths[:, None]
        return scaled_dot_product_attention(query.unsqueeze(1), keys, values, valid.unsqueeze(1)).squeeze(1)

    with pytest.raises(checks.CheckFailed):
        checks.check("02-find-the-bug", scaled)


def test_init_width_needs_both_halves_of_the_matrix():
    def query_half_only(queries, keys, hidden_size, seed):  # ignores the keys' part of each tanh input
        from attncourse.classroom.checks.ch02 import initial_weights

        dq, dk = queries.shape[1], keys.shape[2]
        rms = [float((queries @ initial_weights(s, seed, dq, dk, hidden_size)[:, :dq].T).pow(2).mean().sqrt())
               for s in ("additive", "concat")]
        return rms[0] / rms[1]

    with pytest.raises(checks.CheckFailed, match="02-init-width"):
        checks.check("02-init-width", query_half_only)
    counts = checks.get("02-parameter-counts").make_cases()[0].expected
    assert counts["dot"] is None and counts["additive"] == counts["concat"] + 32 and counts["general"] == 64 * 48 + 64
    assert [c.expected["dot"] for c in checks.get("02-parameter-counts").make_cases()].count(0) >= 1  # equal sizes
# ----------------------------------------------------------------------------- routes a learner could try (issue 23)

from test_exercise_standard import as_learner, grader_reply, judge  # noqa: E402


def _verdicts(exercise_id, answer, tmp_path, monkeypatch):
    """(check cell's message or None, grader's status and message) for `answer` typed in a notebook cell."""
    ex = checks.get(exercise_id)
    answer = _as_cell(answer)
    try:
        checks.check(exercise_id, answer)
        cell = None
    except checks.CheckFailed as err:
        cell = str(err)
    cases = ex.make_cases()
    return cell, judge(ex, cases, grader_reply(ex, answer, cases, tmp_path, monkeypatch))


_as_cell = as_learner  # the standard test's: code filed under a notebook cell's name


def refused(exercise_id, answer, tmp_path, monkeypatch, why="called"):
    cell, (status, message) = _verdicts(exercise_id, answer, tmp_path, monkeypatch)
    assert cell is not None and why in cell, cell
    assert status in ("failed", "error") and why in message, (status, message)


def accepted(exercise_id, answer, tmp_path, monkeypatch):
    cell, (status, message) = _verdicts(exercise_id, answer, tmp_path, monkeypatch)
    assert cell is None and status == "passed", (cell, status, message)


def test_general_score_routes(tmp_path, monkeypatch):
    def aten_bilinear(query, keys, W):
        q = query[:, None].expand(keys.shape[0], keys.shape[1], -1).contiguous()
        return torch.ops.aten.bilinear(q, keys, W[None], None).squeeze(-1)

    def module(query, keys, W):
        from attncourse import LuongAttention
        m = LuongAttention(W.shape[0], W.shape[1], "general").double()
        with torch.no_grad():
            m.W.weight.copy_(W)
            return m.score(query, keys)

    def double_loop(query, keys, W):  # the review's route: one score at a time, through Python floats
        return torch.tensor([[float(query[b] @ W @ keys[b, j]) for j in range(keys.shape[1])]
                             for b in range(keys.shape[0])], dtype=query.dtype)

    def formula_vmapped(query, keys, W):  # the review's route: the one-position formula inside vmap
        return torch.vmap(torch.vmap(lambda s, h: s @ W @ h, in_dims=(None, 0)), in_dims=(0, 0))(query, keys)

    def func_vmap(query, keys, W):  # the same under torch.func's name, one level of batching
        from torch.func import vmap
        return vmap(lambda s, h: h @ (W.T @ s))(query, keys)

    refused("02-general-score", formula_vmapped, tmp_path, monkeypatch)  # as 01-additive-score refuses it
    refused("02-general-score", func_vmap, tmp_path, monkeypatch)
    refused("02-general-score", aten_bilinear, tmp_path, monkeypatch)
    refused("02-general-score", module, tmp_path, monkeypatch)
    refused("02-general-score", double_loop, tmp_path, monkeypatch, why="carries no gradient")
    accepted("02-general-score", lambda query, keys, W: torch.einsum("bd,de,bte->bt", query, W, keys), tmp_path,
             monkeypatch)


def test_find_the_bug_routes(tmp_path, monkeypatch):
    from attncourse import LuongAttention

    def luong_module(query, keys, values, lengths):  # the course's module with the right mask: no bug found
        valid = torch.arange(keys.shape[1]) < lengths[:, None]
        return LuongAttention(query.shape[1], keys.shape[2], "dot")(query, keys, values, mask=valid)[0]

    def aten_kernel(query, keys, values, lengths):
        valid = torch.arange(keys.shape[1]) < lengths[:, None]
        return torch.ops.aten.scaled_dot_product_attention(query[:, None], keys, values, valid[:, None],
                                                           scale=1.0).squeeze(1)

    def course_attention(query, keys, values, lengths):
        valid = torch.arange(keys.shape[1]) < lengths[:, None]
        return scaled_dot_product_attention(query[:, None], keys, values, valid[:, None], scale=1.0).squeeze(1)

    def aten_safe_softmax(query, keys, values, lengths):  # the mask fixed, the softmax left to PyTorch's kernel
        valid = torch.arange(keys.shape[1]) < lengths[:, None]
        scores = torch.einsum("bd,btd->bt", query, keys).masked_fill(~valid, float("-inf"))
        return torch.einsum("bt,btv->bv", torch.ops.aten._safe_softmax(scores, -1), values)

    for route in (luong_module, aten_kernel, course_attention, aten_safe_softmax, _buggy):
        refused("02-find-the-bug", route, tmp_path, monkeypatch, why="")
    for route in (luong_module, aten_kernel, course_attention, aten_safe_softmax):
        refused("02-find-the-bug", route, tmp_path, monkeypatch)
    refused("02-find-the-bug", _from_scratch, tmp_path, monkeypatch, why="not the way")
    accepted("02-find-the-bug", _fixed, tmp_path, monkeypatch)


def test_init_width_refuses_the_checks_reference(tmp_path, monkeypatch):
    from attncourse.classroom.checks.ch02 import init_width_ratio_reference

    refused("02-init-width", lambda *args: init_width_ratio_reference(*args), tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- the prediction is a rule

from test_ch01_checks import rule_prediction_routes  # noqa: E402


def _counts_rule(query_size, key_size, hidden_size, rank):
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731  weight and bias
    return {"dot": 0 if query_size == key_size else None,
            "general": linear(key_size, query_size),
            "concat": linear(query_size + key_size, hidden_size) + linear(hidden_size, 1),
            "additive": linear(query_size, hidden_size) + linear(key_size, hidden_size) + linear(hidden_size, 1),
            "factored": linear(query_size, rank) + linear(key_size, rank)}


def _counts_by_modules(query_size, key_size, hidden_size, rank):
    """The review's route: the exercise's verify cell (build each module, count with biases) inside the answer."""
    from attncourse.classroom.checks.ch02 import counted_parameters
    from attncourse.rnn_attention import AdditiveAttention, LuongAttention

    def with_biases(m):
        return sum(layer.weight.numel() + layer.out_features for layer in m.modules()
                   if isinstance(layer, torch.nn.Linear))

    assert counted_parameters is not None
    return {"dot": None if query_size != key_size else 0,
            "general": with_biases(LuongAttention(query_size, key_size, "general")),
            "concat": with_biases(LuongAttention(query_size, key_size, "concat", hidden_size=hidden_size)),
            "additive": with_biases(AdditiveAttention(query_size, key_size, hidden_size)),
            "factored": rank * (query_size + key_size + 2)}


def _counts_by_checker(*args):
    from attncourse.classroom.checks.ch02 import counted_parameters
    return counted_parameters(*args)


def _counts_by_package_formula(query_size, key_size, hidden_size, rank):
    from attncourse.rnn_attention import score_parameter_count
    rule = _counts_rule(query_size, key_size, hidden_size, rank)
    return {**rule, "general": score_parameter_count("general", query_size, key_size) + query_size}


def _counts_by_torch_linear(query_size, key_size, hidden_size, rank):
    """PyTorch's nn.Linear alone, no course code: building it runs tensor operations, refused."""
    rule = _counts_rule(query_size, key_size, hidden_size, rank)
    return {**rule, "general": sum(p.numel() for p in torch.nn.Linear(key_size, query_size).parameters())}


def _counts_by_meta_linear(query_size, key_size, hidden_size, rank):
    with torch.device("meta"):
        layer = torch.nn.Linear(key_size, query_size)
    return {**_counts_rule(query_size, key_size, hidden_size, rank), "general": layer.weight.numel() + query_size}


def _counts_no_dot_when_equal(query_size, key_size, hidden_size, rank):  # forgets dot exists (with 0) at equal sizes
    return {**_counts_rule(query_size, key_size, hidden_size, rank), "dot": None}


def _counts_concat_like_additive(query_size, key_size, hidden_size, rank):  # one bias too many for concat
    rule = _counts_rule(query_size, key_size, hidden_size, rank)
    return {**rule, "concat": rule["additive"]}


def _counts_factored_as_full(query_size, key_size, hidden_size, rank):
    """Read off the lesson's modules only: the factored score counted as the full general matrix it equals."""
    rule = _counts_rule(query_size, key_size, hidden_size, rank)
    return {**rule, "factored": rule["general"]}


def test_parameter_counts_are_a_rule(tmp_path, monkeypatch):
    rule_prediction_routes("02-parameter-counts", _counts_rule, tmp_path, monkeypatch,
                           measured=(_counts_by_modules, _counts_by_checker, _counts_by_package_formula,
                                     _counts_by_torch_linear, _counts_by_meta_linear),
                           wrong=(_counts_no_dot_when_equal, _counts_concat_like_additive, _counts_factored_as_full))
    with pytest.raises(checks.CheckFailed, match="no entry for 'concat'"):  # the form is still explained
        checks.check("02-parameter-counts", lambda *args: {"dot": None, "general": 1, "additive": 2})


def test_init_width_prediction_is_a_rule(tmp_path, monkeypatch):
    def rule(dq, dk, sq, sk):  # the variance argument, in plain Python
        return ((sq**2 + sk**2) * (dq + dk) / (dq * sq**2 + dk * sk**2)) ** 0.5

    def measured(dq, dk, sq, sk):  # building the modules and measuring inside the prediction: refused
        return init_width_ratio_reference(torch.randn(64, dq) * sq, torch.randn(64, 9, dk) * sk, 32, 0)

    def pasted(dq, dk, sq, sk):  # the checker's reference, its lines pasted into the answer cell
        mean_square = {}
        for score in ("additive", "concat"):
            rows = torch.cat([initial_weights(score, seed, dq, dk, 1024) for seed in range(4)])
            w_s, w_h = rows[:, :dq], rows[:, dq:]
            mean_square[score] = float(sq**2 * w_s.square().sum(1).mean() + sk**2 * w_h.square().sum(1).mean())
        return (mean_square["additive"] / mean_square["concat"]) ** 0.5

    from attncourse.classroom.checks import ch02
    from attncourse.classroom.checks.ch02 import init_width_ratio_reference, initial_weights, width_ratio_measured
    accepted("02-init-width-predict", rule, tmp_path, monkeypatch)
    refused("02-init-width-predict", measured, tmp_path, monkeypatch)
    refused("02-init-width-predict", lambda *args: width_ratio_measured(*args), tmp_path, monkeypatch)
    refused("02-init-width-predict", pasted, tmp_path, monkeypatch)
    # review 12: the checker held the answer as a two-line closed form a learner could paste; it now measures
    assert not hasattr(ch02, "width_ratio_closed_form")
    cell, _ = _verdicts("02-init-width-predict", lambda *args: 2 ** 0.5, tmp_path, monkeypatch)  # the equal-size value
    assert cell is not None and "not right" in cell and "1.41" not in cell.split("hint")[0]
