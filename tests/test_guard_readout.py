"""An answer that builds its own tensors (no tensor among its arguments) still has a read-out budget: it may read
the floor's worth of floating-point numbers into plain Python (loop bounds, a value per block), not all its data.
Before, the budget was sized from the arguments only and an answer given lengths and a seed had none (chapters 13
and 14 closed the gap per exercise)."""

import torch

from attncourse.classroom.checks import forbidden


def _builds(n):
    def answer(seed):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        return sum(x.tolist())
    return answer


def _items(n):
    def answer(seed):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        return sum(x[i].item() for i in range(n))
    return answer


def test_an_answer_without_tensor_arguments_is_held_to_the_floor():
    pol = forbidden.policy(ops=("numpy",))
    for make in (_builds, _items):
        over = forbidden.run(make(forbidden.SCALAR_FLOOR + 1), (0,), {}, pol)
        assert any("scalars" in str(u) or "tolist" in str(u) or "item" in str(u) for u in over["used"]), over
        within = forbidden.run(make(forbidden.SCALAR_FLOOR), (0,), {}, pol)
        assert not within["used"] and within["error"] is None, within


def test_tensor_arguments_still_size_the_budget():
    pol = forbidden.policy(ops=("numpy",))
    x = torch.randn(8 * forbidden.SCALAR_FLOOR)
    quarter = 2 * forbidden.SCALAR_FLOOR
    assert not forbidden.run(lambda t: sum(t[:quarter].tolist()), (x,), {}, pol)["used"]
    assert forbidden.run(lambda t: sum(t[:quarter + 1].tolist()), (x,), {}, pol)["used"]


def test_without_the_numpy_family_nothing_is_counted():
    ran = forbidden.run(_builds(4 * forbidden.SCALAR_FLOOR), (0,), {}, forbidden.policy())
    assert not ran["used"] and ran["error"] is None


def _parsed(text):
    import re
    return [float(x) for x in re.findall(r"-?\d+\.\d+(?:e[-+]\d+)?", text)]


def through_repr(t):
    torch.set_printoptions(precision=17, threshold=10**9)
    try:
        return sum(_parsed(repr(t.flatten())))
    finally:
        torch.set_printoptions(profile="default")


def through_sci_repr(t):
    with torch._tensor_str.printoptions(sci_mode=True, threshold=10**9):
        return sum(_parsed(str(t.flatten())))


def through_save(t):
    import io
    buf = io.BytesIO()
    torch.save(t, buf)
    return len(buf.getvalue())


def through_pickle(t):
    import pickle
    return len(pickle.dumps(t))


def test_numbers_read_out_as_text_or_bytes_count(capsys):
    """Cold review 13 of chapters 00-02 passed 01-additive-score and 02-general-score (grader 2/2) with the inputs
    read out through `repr` at 17 digits or `torch.save` + `struct.unpack`, and the arithmetic in Python loops."""
    pol = forbidden.policy(ops=("numpy",))
    x = torch.randn(4 * forbidden.SCALAR_FLOOR, dtype=torch.float64)
    for answer, name in ((through_repr, "Tensor.__repr__"), (through_sci_repr, "Tensor.__repr__"),
                         (through_save, "torch.save"), (through_pickle, "torch.save")):
        ran = forbidden.run(answer, (x,), {}, pol)
        assert ran["used"] and name in str(ran["used"][0]), (answer.__name__, ran)
    assert torch._tensor_str.PRINT_OPTS.precision == 4  # the answers' own cleanup ran


def test_a_default_print_while_debugging_is_not_a_read_out(capsys):
    pol = forbidden.policy(ops=("numpy",))
    x = torch.randn(4 * forbidden.SCALAR_FLOOR)

    def debugging(t):
        print(t, t[:300], repr(t[:600]))  # default digits: not enough to compute with
        return (t * 2).sum()

    ran = forbidden.run(debugging, (x,), {}, pol)
    assert not ran["used"] and ran["error"] is None, ran
    assert "tensor(" in capsys.readouterr().out


def through_scaled_print(t):
    """The default print of a tensor shifted and scaled by 1e6 (no value near 0, so no scientific notation) shows each
    number to 11 or 12 digits (4 decimals)."""
    return sum(v / 1e6 - 10 for v in _parsed(repr(((t + 10) * 1e6).flatten())))


def through_rounded_print(t):
    """Shifted, scaled and rounded, a floating tensor prints in integer mode, every digit shown (8 here)."""
    shown = __import__("re").findall(r"-?\d+\.", repr(((t + 10) * 1e6).round().flatten()))
    return sum(float(v) / 1e6 - 10 for v in shown)


def test_a_scaled_default_print_is_a_read_out(capsys):
    pol = forbidden.policy(ops=("numpy",))
    x = torch.randn(4 * forbidden.SCALAR_FLOOR, dtype=torch.float64)
    torch.set_printoptions(threshold=10**9)
    try:
        for answer in (through_scaled_print, through_rounded_print):
            ran = forbidden.run(answer, (x,), {}, pol)
            assert ran["used"] and "Tensor.__repr__" in str(ran["used"][0]), (answer.__name__, ran)
            assert abs(answer(x) - float(x.sum())) < 1e-3  # the route really carries the numbers
    finally:
        torch.set_printoptions(profile="default")
