"""The grader, in parts (``python -m attncourse.grade``; see :mod:`.cli` for what it does and every flag).

* :mod:`.results`: the results (per exercise, per notebook) and which chapter a notebook is;
* :mod:`.session`: one student kernel, its cells run with time limits, and the grader's calls into it;
* :mod:`.remote`: what runs in the kernel (the student's function under the check's call guard), how its
  replies are judged here, and the proxy hidden tests call;
* :mod:`.hidden`: hidden tests, read from ``solutions/`` and run in the grading process;
* :mod:`.notebook`: grading one notebook; :mod:`.classrun`: a whole class in worker processes;
* :mod:`.reports`: JSON, gradebook and long CSV, Markdown feedback, console lines; :mod:`.cli`: the command.
"""

from .classrun import collect, grade_all
from .cli import main
from .hidden import hidden_blocks, hidden_tests
from .notebook import LOUD_BYTES, grade_notebook, grade_safely
from .remote import KERNEL_SIDE, judge
from .reports import feedback_markdown, to_json, write_csv_long, write_feedback, write_gradebook
from .results import MAX_NOTEBOOK_BYTES, SOLUTIONS, STATUSES, ExerciseResult, NotebookResult, chapter_of

__all__ = ["ExerciseResult", "KERNEL_SIDE", "LOUD_BYTES", "MAX_NOTEBOOK_BYTES", "NotebookResult", "SOLUTIONS",
           "STATUSES", "chapter_of", "collect", "feedback_markdown", "grade_all", "grade_notebook", "grade_safely",
           "hidden_blocks", "hidden_tests", "judge", "main", "to_json", "write_csv_long", "write_feedback",
           "write_gradebook"]
