"""The grader's public interface, ``python -m attncourse.grade`` (the code lives in
:mod:`attncourse.classroom.grading`; its :mod:`~attncourse.classroom.grading.cli` documents every flag)."""

import sys

from .grading import *  # noqa: F401,F403
from .grading import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
