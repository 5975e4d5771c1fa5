"""A prediction judged whole: a wrong answer is told that it is wrong, never which of its parts are.

Telling a learner which parts of a prediction are wrong ("wrong: weights, context; the other parts are right")
lets them change one part at a time until the check passes: a few shapes to choose from per part, tried one by
one, pass the exercise without a single prediction. Counting the wrong parts leaks the same thing (change one
part, see the count move). So :func:`whole` judges the answer as one: it says what is wrong with its *form* (not
a tuple, the wrong number of items, an item that is not a shape, a missing key: nothing the exercise does not
say), and otherwise only that the prediction is not right. The exercise's hint, shown with it, teaches how to
work the answer out without naming any value.

Used by chapters 01-03 (``Case(..., compare=whole(...))``); :func:`attncourse.classroom.checks.feedback` passes
a case's own rule through unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

NOT_RIGHT = ("that prediction is not right (a prediction is judged as a whole: the check does not say which part "
             "differs, so work each one out again from the hint rather than trying values)")


def _is_shape(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in x)


def whole(what: str, kind: str = "shapes") -> Callable[[Any, Any], str | None]:
    """A compare rule ``(got, expected) -> message | None`` for a prediction: None when `got` equals `expected`
    (tuples and lists alike), a message about the form when the form is wrong, else :data:`NOT_RIGHT`.

    `what` names the answer in messages ("a tuple of four shapes"); `kind` is "shapes" (a tuple of shapes, each
    a tuple of ints), "dict" (a dict whose keys the exercise names, each an int or None) or "flags" (the same with
    True or False for each key)."""
    if kind not in ("shapes", "dict", "flags"):
        raise ValueError(f"kind must be 'shapes', 'dict' or 'flags', got {kind!r}")

    def rule(got: Any, expected: Any) -> str | None:
        if kind == "shapes":
            if not isinstance(got, (tuple, list)) or len(got) != len(expected):
                return f"expected {what}, got {_kind(got)}"
            if not all(_is_shape(g) for g in got):
                return f"expected {what}: each item a tuple of ints, like (2, 3), but one is not"
            if all(tuple(g) == tuple(e) for g, e in zip(got, expected)):
                return None
            return NOT_RIGHT
        if not isinstance(got, dict):
            return f"expected {what}, got {_kind(got)}"
        got = {str(k): v for k, v in got.items()}
        missing = [k for k in expected if k not in got]
        if missing:
            return f"expected {what}; yours has no entry for {', '.join(map(repr, missing))}"
        extra = [k for k in got if k not in expected]
        if extra:
            return f"expected {what}; yours has entries the exercise does not ask for: {', '.join(map(repr, extra))}"
        if kind == "flags":
            odd = [k for k, v in got.items() if not isinstance(v, bool)]
            if odd:
                return f"expected {what}: each entry True or False, but {', '.join(map(repr, odd))} is not"
        else:
            odd = [k for k, v in got.items() if not (v is None or (isinstance(v, int) and not isinstance(v, bool)))]
            if odd:
                return f"expected {what}: each entry an int or None, but {', '.join(map(repr, odd))} is not"
        if all(_same(got[k], e) for k, e in expected.items()):
            return None
        return NOT_RIGHT

    return rule


def _same(got: Any, expected: Any) -> bool:
    if expected is None or got is None:
        return got is expected
    if isinstance(got, bool) or isinstance(expected, bool):
        return got is expected
    return type(got) is type(expected) and got == expected


def _kind(x: Any) -> str:
    if isinstance(x, (tuple, list, dict)):
        return f"a {type(x).__name__} of {len(x)} items"
    return f"a {type(x).__name__}"


# Python's random draws, for a prediction that must be a rule rather than a simulation on drawn weights (``forbid=``).
RANDOM_DRAWS = tuple(f"random.{n}" for n in ("Random", "random", "gauss", "normalvariate", "uniform", "randint",
                                             "randrange", "choice", "choices", "sample", "shuffle", "getrandbits",
                                             "seed"))
RANDOM_DRAWS += tuple(f"random.Random.{n}" for n in ("random", "gauss", "normalvariate", "uniform", "randint",
                                                     "randrange", "choice", "choices", "sample", "shuffle",
                                                     "getrandbits", "seed"))
