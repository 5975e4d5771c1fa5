"""A prediction is a commitment: after three different wrong predictions, the check stops judging the exercise.
A find-the-bug exercise gets :data:`BUG_LIMIT` different wrong results for the same reason (see below).

A prediction check answers one bit ("right" or "not right"), and a wrong answer is judged as a whole
(:mod:`.predictions`) so that it never says which part is off. One bit per try is still a search: a loop over a
family of candidate answers (96 plausible shape rules, 65 parameter counts) calling ``check`` finds the right one
in seconds, without a single prediction. So a prediction exercise gets :data:`LIMIT` different wrong answers; after
that its check says so and judges no more, in this kernel and in later ones (the count is kept in a small file,
:func:`state_file`). A wrong answer tried again is not counted twice, and an answer of the wrong form (a list
where a tuple of shapes is asked, a missing key) is not counted at all: the check says what is wrong with its form.

A find-the-bug check says which case is wrong and how, so a search over small edits of the given function (swap one
name for another until the check passes: a cold reader passed 11-find-the-bug-1 with 152 calls) finds the fix
without finding the bug. A bug exercise therefore gets :data:`BUG_LIMIT` different wrong results: enough to
correct a slip, not enough for a search. An edit that raises, or that gives the right result the wrong way, is told
and not counted.

The grader does not read the file: it judges the answer the notebook hands in, in a kernel of its own, where a loop
that calls ``check`` meets the same limit. The course's own tests set ``ATTNCOURSE_PREDICTION_TRIES=unlimited``
before the checks are imported (they hand every check many wrong answers on purpose); the setting is read once, at
import, so a notebook cell that changes the environment later changes nothing. What this does not stop is named in
the README ("What the guard cannot see"): the check runs in the learner's own Python, so top-level code can patch
this module, delete the file or call the comparison behind the check; what such a search finds is not a prediction.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

LIMIT = 3
BUG_LIMIT = 8  # different wrong results a find-the-bug check judges (see above); the setting's "unlimited" lifts it
_ENV = "ATTNCOURSE_PREDICTION_TRIES"  # a number of tries, or "unlimited"
_STATE_ENV = "ATTNCOURSE_STATE"  # the folder of the count's file (default: ~/.cache/attncourse)
_FORM = ("expected ", "your dict has no entry")  # how a message about an answer's form begins
_SEEN: dict[str, set[str]] = {}  # this process's wrong answers, by exercise id
# Read once, when the checks are imported: a notebook cell that changes the environment later changes nothing here.
_SETTING = os.environ.get(_ENV, "")
_STATE_ROOT = os.environ.get(_STATE_ENV, "")
# Wrong answers everyone is shown, not counted: lesson 00's demonstration of a wrong 01-predict-shapes rule (the same
# for every learner, so trying it tells nothing; tests/test_tries.py recomputes its digest from the lesson's cell).
DEMO = {"01-predict-shapes": "a47b3643804c0240"}


def limit(category: str = "predict") -> int | None:
    """The number of different wrong answers an exercise of `category` allows (None: no limit): a prediction's from
    the environment (default :data:`LIMIT`), a find-the-bug exercise's :data:`BUG_LIMIT` unless that says
    "unlimited"; other categories have none."""
    value = _SETTING.strip().lower()
    if category not in ("predict", "bug") or value in ("unlimited", "none", "0"):
        return None
    if category == "bug" or value in ("", "default"):
        return BUG_LIMIT if category == "bug" else LIMIT
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{_ENV} must be a positive integer or 'unlimited', got {value!r}") from None
    if n < 0:
        raise ValueError(f"{_ENV} must be a positive integer or 'unlimited', got {n}")
    return n


def state_file() -> Path:
    """Where the wrong answers are counted across kernels: ``$ATTNCOURSE_STATE/tries.json`` or
    ``~/.cache/attncourse/tries.json``."""
    root = _STATE_ROOT
    return (Path(root) if root else Path.home() / ".cache" / "attncourse") / "tries.json"


def _load() -> dict[str, list[str]]:
    try:
        data = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): [str(x) for x in v] for k, v in data.items() if isinstance(v, list)}


def _save(data: dict[str, list[str]]) -> None:
    path = state_file()
    try:  # the count is a speed bump, never a reason for a check to fail
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


def used(exercise_id: str) -> set[str]:
    """The different wrong answers given to `exercise_id` so far (this process's and the file's)."""
    return set(_SEEN.get(exercise_id, set())) | set(_load().get(exercise_id, []))


def fingerprint(case_name: str, got: Any) -> str:
    """A short digest of a wrong answer as the check saw it: the case it failed on and what it gave there (two rules
    that give the same wrong value on the same case are one try: the check told them nothing new)."""
    h = hashlib.sha256(case_name.encode())
    h.update(_bytes(got))
    return h.hexdigest()[:16]


def _bytes(x: Any) -> bytes:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        return f"tensor{tuple(t.shape)}{t.dtype}".encode() + t.contiguous().view(-1).to(torch.float64).numpy().tobytes()
    if isinstance(x, dict):
        return b"{" + b",".join(_bytes(k) + b":" + _bytes(v) for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))) + b"}"
    if isinstance(x, (tuple, list)):
        return b"(" + b",".join(_bytes(v) for v in x) + b")"
    return f"{type(x).__name__}:{x!r}".encode()


def is_form_error(detail: str) -> bool:
    """Whether a failure message is about the answer's form (not counted as a try)."""
    return detail.startswith(_FORM)


def exhausted(exercise_id: str, category: str = "predict") -> str | None:
    """The message a check shows instead of judging, once `exercise_id` has used its tries; else None."""
    n = limit(category)
    if n is None:
        return None
    spent = used(exercise_id)
    if len(spent) < n:
        return None
    if category == "bug":
        return (f"✗ {exercise_id}: {len(spent)} different fixes gave wrong results, so this check judges no more "
                f"answers to it (a further try would be a search over edits, not a diagnosis). Find the line that "
                f"is wrong by reading the function against the lesson, and test your fix on your own inputs; the "
                f"grader judges the answer your notebook hands in.")
    return (f"✗ {exercise_id}: {len(spent)} different predictions were not right, so this check judges no more "
            f"answers to it (a further try would be a search, not a prediction). Work the answer out from the "
            f"hint and the lesson; the grader judges the answer your notebook hands in.")


def record(exercise_id: str, fp: str, category: str = "predict") -> str:
    """Count the wrong answer `fp` for `exercise_id` (once per different answer); return the line the learner sees
    about the tries left."""
    n = limit(category)
    if n is None or DEMO.get(exercise_id) == fp:
        return ""
    _SEEN.setdefault(exercise_id, set()).add(fp)
    data = _load()
    if fp not in data.get(exercise_id, []):
        data.setdefault(exercise_id, []).append(fp)
        _save(data)
    spent = len(used(exercise_id))
    left = max(0, n - spent)
    if left == 0:
        return f"that was the last of {n} tries: this check will not judge another answer to this exercise"
    if category == "bug":
        return (f"{spent} of {n} tries used: after {n} different wrong results this check stops judging this "
                f"exercise, so find the bug rather than trying edits")
    return (f"{spent} of {n} tries used: after {n} different wrong predictions this check stops judging "
            f"this exercise, so work the answer out rather than trying values")


def _reset(exercise_id: str | None = None) -> None:
    """Forget the wrong answers (of one exercise, or all): for the course's tests."""
    data = _load()
    if exercise_id is None:
        _SEEN.clear()
        data = {}
    else:
        _SEEN.pop(exercise_id, None)
        data.pop(exercise_id, None)
    _save(data)
