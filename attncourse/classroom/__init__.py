"""The classroom machinery, kept apart from the attention library the lessons teach.

* :mod:`attncourse.classroom.checks`: one definition per exercise (cases, hints, forbidden shortcuts),
  driving both a learner's check cell and the grader;
* :mod:`attncourse.classroom.grading`: grades submitted notebooks in separate kernels (``python -m
  attncourse.grade``; :mod:`attncourse.classroom.grade` is its public face): kernel session, remote calls,
  hidden tests, reports and the command line in separate modules;
* :mod:`attncourse.classroom.release`: builds the student bundle (``python -m attncourse.release``);
* :mod:`attncourse.classroom.nbtools`: builds, executes and converts the course's notebooks
  (``python -m attncourse.nbtools``).

Nothing in the library modules (``attncourse.sdpa``, ``attncourse.flash``, ...) imports from here.
"""
