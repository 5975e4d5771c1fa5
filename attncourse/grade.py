"""`python -m attncourse.grade`: a short name for :mod:`attncourse.classroom.grade` (see there)."""

from attncourse.classroom.grade import main

if __name__ == "__main__":
    raise SystemExit(main())
