"""Salted seeds: the grader's cases are not the notebook's.

A check cell builds its cases from fixed seeds, so a notebook could build the same cases at top level (the
registry is importable), keep their expected values in a table, and hand in an answer that looks its input up.
The grader closes that route: it draws a secret salt per run and builds the cases with every seed mixed with it
(``torch.manual_seed``, ``torch.Generator().manual_seed``, NumPy's and Python's seeding), so the inputs and the
expected values are ones the notebook has never seen. The student's answer runs in its kernel under the same
salt (an experiment that seeds itself with the case's seed meets the same random numbers as the reference did),
and only during the grader's call, after every cell of the notebook has run.

Self-contained (stdlib, torch, numpy): the grader sends this source into the student's kernel, as it does the
guard's (:mod:`.forbidden`).
"""

from __future__ import annotations

import contextlib
import hashlib
import random as _random


def mix(seed, salt, bits=63):
    """The seed used in place of `seed` under `salt` (an int in [0, 2**bits)); anything but an int is kept."""
    if salt is None or isinstance(seed, bool) or not isinstance(seed, int):
        return seed
    digest = hashlib.blake2b(f"{salt}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - bits)


@contextlib.contextmanager
def salted(salt):
    """Every seed set inside the block is mixed with `salt` (``None``: nothing changes)."""
    if salt is None:
        yield
        return
    import numpy as np
    import torch

    base_generator = torch._C.Generator

    class _Same(type(base_generator)):
        def __instancecheck__(cls, obj):  # isinstance(g, torch.Generator) keeps meaning what it meant
            return isinstance(obj, base_generator)

    class Generator(base_generator, metaclass=_Same):
        def manual_seed(self, seed):
            return base_generator.manual_seed(self, mix(int(seed), salt))

    base_rs, base_random = np.random.RandomState, _random.Random

    class RandomState(base_rs):
        def __init__(self, seed=None):
            super().__init__(mix(seed, salt, 32))  # the legacy generator takes seeds below 2**32

        def seed(self, seed=None):
            super().seed(mix(seed, salt, 32))

    class Random(base_random):
        def seed(self, a=None, version=2):
            super().seed(mix(a, salt), version)

    saved = [(torch, "manual_seed", torch.manual_seed), (torch.random, "manual_seed", torch.random.manual_seed),
             (torch, "Generator", torch.Generator), (np.random, "seed", np.random.seed),
             (np.random, "default_rng", np.random.default_rng), (np.random, "RandomState", np.random.RandomState),
             (_random, "seed", _random.seed), (_random, "Random", _random.Random)]
    torch_seed, np_seed, np_rng, py_seed = torch.manual_seed, np.random.seed, np.random.default_rng, _random.seed
    torch.manual_seed = torch.random.manual_seed = lambda seed: torch_seed(mix(int(seed), salt))
    torch.Generator = Generator
    np.random.seed = lambda seed=None: np_seed(mix(seed, salt, 32))
    np.random.default_rng = lambda seed=None: np_rng(mix(seed, salt))
    np.random.RandomState = RandomState
    _random.seed = lambda a=None, version=2: py_seed(mix(a, salt), version)
    _random.Random = Random
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
