"""`python -m attncourse.release`: a short name for :mod:`attncourse.classroom.release` (see there)."""

from attncourse.classroom.release import main

if __name__ == "__main__":
    raise SystemExit(main())
