"""The answers of two predictions (05-conversion-predict, 06-passkey-predict) are written in no cell a learner can
read: not in the lesson, not in the exercise notebook (before or after the prediction), and the cell that holds the
measurement against the prediction asserts it against the learner's function, not against typed verdicts."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

# literals that state an answer: the verdict rule of exercise 8a and the found set of exercise 10a, as the earlier
# asserts and the solution's discussion wrote them
LEAKS = {
    "05_mqa_gqa": ("predicted_closer", ("o == 1", "o == 0", "others == 1", "others == 0", "rows[0.5, 0.5]",
                                        "mean-pooling stays closer", "The verdict flips", "is then exact")),
    "06_positions_alibi": ("predicted_kept", ("1:4", "[1, 2, 3]", "1, 2 or 3", "1 to 3 pairs", "Keeping 1,",
                                              "(1, 2, 3)", "table[:, 5:]")),
}


def _cells(path: Path):
    for cell in nbformat.read(path, as_version=4).cells:
        outputs = "".join(o.get("text", "") for o in cell.get("outputs", []))
        yield cell, cell.source + "\n" + outputs


@pytest.mark.parametrize("name", sorted(LEAKS))
def test_no_answer_literal_where_a_learner_reads(name):
    _, literals = LEAKS[name]
    for where in ("exercises", "notebooks"):
        for index, (_, text) in enumerate(_cells(ROOT / where / f"{name}.ipynb")):
            found = [lit for lit in literals if lit in text]
            assert not found, f"{where}/{name}.ipynb cell {index} states the prediction's answer: {found}"


@pytest.mark.parametrize("name", sorted(LEAKS))
def test_solution_discussion_is_solution_only_and_verdict_is_asserted(name):
    function, literals = LEAKS[name]
    cells = list(_cells(ROOT / "solutions" / f"{name}.ipynb"))
    for cell, text in cells:
        if any(lit in cell.source for lit in literals) and f"def {function}" not in cell.source:
            assert "solution-only" in cell.metadata.get("tags", []), cell.source[:80]
    gated = [cell.source for cell, _ in cells if "passed(" in cell.source and f"{function}(" in cell.source]
    assert len(gated) == 1 and "assert" in gated[0]
    assert any(f"== {x}" in gated[0] or f"== sorted(set({function}" in gated[0] for x in ("predicted",))
