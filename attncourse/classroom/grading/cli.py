"""Grade student notebooks: one, or a whole class in parallel.

    python -m attncourse.grade PATH... [--json FILE] [--csv FILE] [--csv-long FILE] [--feedback DIR]
                               [--jobs N] [--timeout S] [--cell-timeout S] [--solutions DIR | --no-hidden]
                               [--chapter NN] [--[no-]progress]

PATH is a notebook or a folder of submissions. In a folder, a notebook directly inside it belongs to
the student named like the file (``alice.ipynb``); a notebook in a sub-folder belongs to the student
named like that sub-folder (``alice/03_scaled_dot_product_attention.ipynb``, or nbgrader's
``submitted/alice/ps03/03_....ipynb`` when PATH is ``submitted``). A notebook named on the command
line belongs to the student named like the file.

How a notebook is graded
    Each notebook runs in its own Jupyter kernel (never in the grading process), cell by cell with a
    per-cell and a per-notebook time limit, errors and all, except its check cells (nbgrader "grade"
    cells without a solution), which the grader replaces with its own checks. Whatever the notebook
    prints is discarded (it can print gigabytes: the grader keeps none of it). Then, for every exercise
    of its chapter (the registry in ``attncourse.classroom.checks``), the grader builds the cases *here*, sends
    only their inputs to the kernel, calls the student's function there, brings the results back (loaded
    with ``torch.load(weights_only=True)``: tensors and plain data only) and compares them here with
    expected values computed here. Check cells, printed "passed" lines and anything the notebook patches
    in its own kernel (the checker, ``attncourse``'s reference implementations, ``torch.testing``)
    cannot change the verdict. The student's function runs under the same call guard as the check cell
    (``attncourse.classroom.checks.forbidden``): an answer that calls a function its exercise forbids (the
    library's own, under any name) fails. A wrong prediction is told only that it is not right (never which
    part, nor the expected value), in the console, the JSON and the feedback alike.

Hidden tests
    ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` blocks in the check cells of
    ``solutions/NN_*.ipynb`` (the cell's nbgrader ``grade_id`` names the exercise) run after the
    registry's cases pass. They run *in this process*, not in the student's kernel: the exercise's
    target name is bound to a proxy that calls the student's function in the kernel (inputs out, result
    back, as above), so the assertions (``torch.testing.assert_close``, ``assert``) are the grader's own
    and the notebook cannot patch them. A hidden block must therefore be self-contained: it may use
    ``torch``, ``np``, ``math``, ``F`` and the exercise's target, and must import anything else
    (``from attncourse import ...`` gives the genuine package here). Arguments and results travel as
    tensors, NumPy arrays, numbers, strings, tuples, lists and dicts. An exception the student's code
    raises is re-raised here with the same built-in type, so a hidden test can expect a ValueError.
    ``exercises/`` and releases never contain these blocks; without a ``solutions/`` folder (``--solutions``)
    hidden tests are skipped and the run says so.

Output
    Console: one line per notebook and one per exercise, in the order of the paths (a folder's notebooks
    sorted by path), whatever order they finish in; a notebook that could not be read is one line. ``--json``: a list with one object per
    notebook (``notebook``, ``student``, ``score``, ``max_score``, ``message``, ``seconds``, ``exercises``: ``id``,
    ``points``, ``max_points``, ``status`` in passed/failed/error/timeout/missing, ``message``).
    ``--csv``: a gradebook, one row per student, columns ``student``, one per exercise id (points),
    ``total``, ``max_total``: import it into an LMS, mapping ``student`` to the user name or ID.
    ``--csv-long``: one row per student and exercise with points, status and message.
    ``--feedback DIR``: ``DIR/<student>/<notebook>.md`` saying what passed, what failed and why.
    The exit status is 0 whenever grading finished, whatever the scores.

Threat model: the grader defends against tampering *inside the notebook's Python* (patching, fake
prints, edited or deleted check cells, edited metadata). Student code runs with the grader's user
rights; grade untrusted submissions inside a container or as an unprivileged user.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .. import checks
from .classrun import collect, grade_all
from .reports import print_result, to_json, write_csv_long, write_feedback, write_gradebook
from .results import SOLUTIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncourse.grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="notebooks or folders of submissions")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--csv", type=Path, help="write a gradebook (one row per student) to this CSV file")
    parser.add_argument("--csv-long", type=Path, help="write one row per student and exercise to this CSV file")
    parser.add_argument("--feedback", type=Path, metavar="DIR", help="write DIR/<student>/<notebook>.md feedback")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="notebooks graded in parallel (default 1)")
    parser.add_argument("--cell-timeout", type=float, default=60, help="seconds per cell (default 60)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per notebook (default 600)")
    parser.add_argument("--solutions", type=Path, default=SOLUTIONS,
                        help="folder of solution notebooks holding hidden tests (default: the course's solutions/)")
    parser.add_argument("--no-hidden", action="store_true",
                        help="do not run hidden tests (a learner's self-check: `./course check`)")
    parser.add_argument("--chapter", help="grade every notebook as this chapter (e.g. 03) instead of reading "
                                          "it from each notebook's metadata, grade ids or file name")
    parser.add_argument("--salt", type=int, default=None,
                        help="mix the cases' seeds with this number (default: a fresh secret one per notebook, so "
                             "that no table of the check cells' expected values answers the grader); give one to "
                             "reproduce a grade exactly")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on stderr (default: when stderr is a terminal)")
    args = parser.parse_args(argv)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # nbclient's abandoned pollers after timeouts

    items = collect(args.paths)
    missing = [str(p) for p, _ in items if not p.exists()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if not items:
        parser.error("no notebooks found")
    solutions = None if args.no_hidden else args.solutions
    if solutions is not None and not solutions.is_dir():
        print(f"note: no solutions folder at {args.solutions}: hidden tests are not run", file=sys.stderr)
    checks.registry()  # import every chapter's checks before any student code runs
    results = grade_all(items, jobs=max(1, args.jobs), cell_timeout=args.cell_timeout, timeout=args.timeout,
                        solutions=solutions, chapter=args.chapter, on_result=print_result, salt=args.salt,
                        progress=sys.stderr.isatty() if args.progress is None else args.progress)
    if args.json:
        args.json.write_text(json.dumps(to_json(results), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.csv:
        write_gradebook(results, args.csv)
    if args.csv_long:
        write_csv_long(results, args.csv_long)
    if args.feedback:
        write_feedback(results, args.feedback)
    total = sum(r.score for r in results)
    if len(results) > 1:  # one notebook (a learner's ./course check): its own line above already gives the score
        print(f"graded {len(results)} notebook(s) of {len({r.student for r in results})} student(s); "
              f"mean score {total / len(results):.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
