"""Launching W local processes joined in a gloo process group (used by :mod:`attncourse.ring`).

:func:`run_distributed` starts `world_size` processes with ``torch.multiprocessing`` joined in a gloo group (on
127.0.0.1, a free port chosen by the operating system), runs a function of this package in each and returns what
each rank returned.
"""

from __future__ import annotations

import datetime
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _validate

__all__ = ["run_distributed"]


def _entry(rank: int, fn: Callable, world_size: int, port: int, folder: str, timeout: float, args: tuple) -> None:
    torch.set_num_threads(1)  # W processes share the machine's cores
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        dist.barrier()  # nobody leaves while a peer may still be receiving from it
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
                    start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in `world_size` local processes joined in a gloo group.

    `fn` must be importable by the children (a module-level function of a package, not one defined in a
    notebook). Returns the list of what each rank returned. The rendezvous store lives in this process on a
    port the OS picks, so parallel launches never collide. `start_method` defaults to "forkserver" where
    available (one server imports torch once and forks the workers) and "spawn" elsewhere. A child that
    raises makes this raise; past `timeout` seconds the children are terminated and TimeoutError is raised.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _validate.positive_int("world_size", world_size)
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    if module in (None, "__main__", "__mp_main__") or "<" in name:  # a notebook's function, a lambda, a closure
        raise ValueError(f"fn must be importable by the child processes: {name} in {module} is not; define it "
                         f"at the top level of a module")
    methods = multiprocessing.get_all_start_methods()
    start_method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", __name__])
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="attncourse_ring_") as folder:
        context = torch.multiprocessing.start_processes(
            _entry, args=(fn, world_size, store.port, folder, timeout, args), nprocs=world_size,
            join=False, start_method=start_method)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} processes running {fn.__qualname__} did not finish "
                                       f"in {timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


