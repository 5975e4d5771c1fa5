"""Session setup shared by every test, including nbval's notebook items.

Kernels started by nbval and by our own notebook runner inherit this process's environment. With
``MPLBACKEND=Agg`` (common in CI images) matplotlib in the kernel draws nothing inline, so every plotting
cell loses the display output stored in the notebook and nbval reports "Missing output fields". Notebooks
must be compared under the inline backend they were executed with, so drop any other backend here.
"""

import os

if "inline" not in os.environ.get("MPLBACKEND", "inline"):
    os.environ.pop("MPLBACKEND")

# Chapter 10's kernels autotune over a small search space in the tests (two configs, not 36, per kernel and shape:
# on a GPU, compiling the full space for every test shape dominated the run). The benchmark and learners keep the
# full space; see attncourse.triton_common.autotune_search.
os.environ.setdefault("ATTNCOURSE_AUTOTUNE", "quick")

# One intra-op thread per process: the suite runs one pytest worker per core, and each worker's notebook kernel,
# grader kernel or unit test would otherwise start a thread per core too, so two workers on a 2-core CI machine
# would run four busy threads. Lessons that time something set their own thread count. Kernels inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A prediction check stops judging an exercise after three different wrong answers, counted in a file under the
# learner's home (attncourse.classroom.checks.tries). The tests hand checks many wrong answers on purpose, so they
# run without the limit; tests/test_tries.py turns it on where it tests it.
os.environ.setdefault("ATTNCOURSE_PREDICTION_TRIES", "unlimited")
