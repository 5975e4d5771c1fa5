"""`python -m attncourse.nbtools`: a short name for :mod:`attncourse.classroom.nbtools` (see there)."""

from attncourse.classroom.nbtools import main

if __name__ == "__main__":
    raise SystemExit(main())
