"""Chapter 02's exercise 5 (implement Luong et al.'s local-p weights, eqs. 9-10), solutions/02_luong_attention.ipynb.

Expected values come from the package's ``LocalPAttention`` holding the case's tensors, so that its gradients reach
them; the answer may not use it.
"""

from __future__ import annotations

import torch

from attncourse.rnn_attention import LocalPAttention
from . import Case, exercise, graphs


def _held(w: torch.Tensor, w_p: torch.Tensor, v_p: torch.Tensor, window: int) -> LocalPAttention:
    """A LocalPAttention (float64) holding these very tensors: W (Dq, Dk), W_p (H, Dq), v_p (H,)."""
    with torch.random.fork_rng(devices=[]):  # building a module draws from the global generator: keep the learner's
        blank = LocalPAttention(w.shape[0], w.shape[1], window, hidden_size=w_p.shape[0]).double()
    return graphs.holding(blank, {"W": w, "W_p": w_p, "v_p": v_p[None]})


def reference_weights(queries, keys, lengths, W, W_p, v_p, window):
    """The (B, Tq, T) local-p weights of `LocalPAttention` with these weights, over each row's first `lengths`."""
    mask = torch.arange(keys.shape[1]) < lengths[:, None]  # (B, T)
    return _held(W, W_p, v_p, window)(queries, keys, mask=mask)[1]


def _shortcut_module(queries, keys, lengths, W, W_p, v_p, window):
    """The package's module holding the same weights: must be refused."""
    mask = torch.arange(keys.shape[1]) < lengths[:, None]
    module = LocalPAttention(W.shape[0], W.shape[1], window, hidden_size=W_p.shape[0]).double()
    return graphs.holding(module, {"W": W, "W_p": W_p, "v_p": v_p[None]})(queries, keys, mask=mask)[1]


def _shortcut_masked_api(queries, keys, lengths, W, W_p, v_p, window):
    """Eqs. 9-10 written out, but the window's softmax by PyTorch's torch.masked.softmax: refused, as in chapter 01's
    padding exercise (masking the scores outside the window is part of the skill here too)."""
    T = keys.shape[1]
    p = lengths[:, None].to(queries.dtype) * torch.sigmoid(torch.tanh(queries @ W_p.T) @ v_p)
    offset = torch.arange(T, dtype=queries.dtype) - p[..., None]
    keep = (offset.abs() <= window) & (torch.arange(T) < lengths[:, None])[:, None]
    align = torch.masked.softmax(queries @ W @ keys.transpose(1, 2), -1, mask=keep).nan_to_num(0.0)
    return align * torch.exp(-offset**2 / (2 * (window / 2) ** 2))


@exercise("02-local-p", "local_p_weights", points=2, category="implement",
          forbid=("attncourse.rnn_attention.LocalPAttention", "attncourse.rnn_attention.LocalMAttention",
                  "attncourse.rnn_attention.attend", "attncourse.sdpa.safe_softmax", *graphs.NO_CUSTOM_GRADIENT),
          # PyTorch's masked softmaxes are refused as in 01-padding-mask (torch.masked's family is judged by name)
          allow=(), ops=("attention", "aten::_safe_softmax", "aten::_masked_softmax", "aten::_sparse_softmax",
                         "aten::_sparse_log_softmax", "aten::masked_log_softmax", "aten::masked_softmin"),
          shortcuts=(_shortcut_module, _shortcut_masked_api),
          prop_doc="output equality, and the gradients: each case is built so that one misreading of eqs. 9-10 "
                   "fails it (the softmax over all positions instead of the window, the weights renormalised after "
                   "the Gaussian, sigma = D instead of D/2, the padded length T for S, a window wider than the "
                   "sequence, a predicted position near either end), and two cases ask for the gradients of all five "
                   "tensors for one fixed upstream gradient: W_p and v_p learn only through the Gaussian's pull on "
                   "p_t, so a rounded or detached position fails there, as does anything computed outside PyTorch",
          hint="for a padded row, which length does eq. 9 scale the sigmoid by: the row's, or the batch's T? Which "
               "positions does the softmax run over, and which get no weight at all? How wide is the Gaussian, in "
               "terms of D, and does the paper renormalise the weights after multiplying by it?")
def _local_p():
    """Luong et al.'s local-p attention weights (eqs. 9-10) for a batch of queries over padded keys."""
    gen = torch.Generator().manual_seed(23)
    cases = []

    def draw(b, tq, t, dq, dk, h, lengths, window, position_scale=1.0):
        q = torch.randn(b, tq, dq, generator=gen, dtype=torch.float64)
        k = torch.randn(b, t, dk, generator=gen, dtype=torch.float64)
        w = torch.randn(dq, dk, generator=gen, dtype=torch.float64) / dq**0.5
        w_p = torch.randn(h, dq, generator=gen, dtype=torch.float64) / dq**0.5
        v_p = torch.randn(h, generator=gen, dtype=torch.float64) * position_scale
        return q, k, torch.tensor(lengths), w, w_p, v_p, window

    for name, size in {
        "B=2, 3 queries over 8 positions, window D=2": (2, 3, 8, 4, 4, 4, [8, 8], 2),
        "padded rows (lengths 9, 5 and 3 of T=9): S in eq. 9 is each row's own length": (3, 4, 9, 4, 6, 5, [9, 5, 3], 2),
        "D=1 (sigma = 0.5), Dq=6, Dk=3, H=4": (2, 5, 10, 6, 3, 4, [10, 7], 1),
        "a window wider than the sequence (D=16 over 6 positions): the Gaussian still weighs": (2, 3, 6, 4, 4, 4, [6, 4],
                                                                                               16),
        "predicted positions near either end (a large v_p saturates the sigmoid)": (2, 6, 12, 4, 4, 8, [12, 11], 3,
                                                                                    12.0),
    }.items():
        args = draw(*size)
        with torch.no_grad():
            cases.append(Case(name, args, expected=reference_weights(*args), rtol=1e-8, atol=1e-10))
    for size in ((2, 3, 8, 4, 4, 4, [8, 6], 2), (4, 6, 14, 5, 3, 6, [14, 9, 12, 5], 3)):  # training: W_p, v_p learn
        args = draw(*size)
        cases.append(graphs.backward_case(f"the backward pass: gradients of queries, keys, W, W_p and v_p "
                                          f"(B={size[0]}, T={size[2]}, D={size[7]})", args, reference_weights))
    return cases
