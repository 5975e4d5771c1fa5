"""Runs of a package script spread over forked processes, safely (used by the FULL=1 scripts)."""

from __future__ import annotations


class forked_map:
    """``with forked_map(n) as run: for r in run(f, items)``: results in order, from n forked processes (in this one
    when n is 1 or fork is missing). concurrent.futures, not multiprocessing.Pool: a worker that dies raises
    BrokenProcessPool here instead of leaving the loop waiting for a result that never comes."""

    def __init__(self, processes: int):
        self.processes, self.executor = processes, None

    def __enter__(self):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if self.processes > 1 and "fork" in multiprocessing.get_all_start_methods():
            self.executor = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("fork"))
            return lambda f, items: self.executor.map(f, items)
        return map

    def __exit__(self, *exc):
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)
        return False
