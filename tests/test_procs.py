"""The FULL=1 scripts' process pools: bad arguments are refused before any process starts, and a worker that
dies makes the loop raise instead of waiting for ever (a learner handing `variant_claims.run_all` in as an answer
once left a check cell, and CI, waiting on workers the guard had refused)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from attncourse import variant_claims as vc


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(path=torch.zeros(3)), TypeError, "path must be a str"),
    (dict(path="x.json", processes=0), ValueError, "processes must be a positive int"),
    (dict(path="x.json", processes=2.0), ValueError, "processes must be a positive int"),
    (dict(path="x.json", part=(2, 2)), ValueError, "part must be a tuple"),
])
def test_run_all_refuses_bad_arguments_before_starting_anything(kwargs, error, words, tmp_path):
    with pytest.raises(error, match=words):
        vc.run_all(**kwargs)


def test_run_gpts_refuses_bad_seeds():
    with pytest.raises(TypeError, match="seeds must be"):
        vc.run_gpts("x.json", 1, seeds=torch.zeros(2))


def test_a_worker_that_dies_makes_the_loop_raise_not_wait():
    code = textwrap.dedent("""
        import os
        from attncourse._procs import forked_map

        class Refused(BaseException):
            pass

        def job(i):
            if i == 1:
                raise Refused("refused inside the worker")
            return i

        def die(i):
            os._exit(3)

        for f in (job, die):
            try:
                with forked_map(2) as run:
                    list(run(f, range(4)))
            except BaseException as err:
                print(f.__name__, type(err).__name__)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["job", "Refused", "die", "BrokenProcessPool"], done.stdout + done.stderr
