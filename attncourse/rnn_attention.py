r"""Attention for recurrent encoder-decoders: Bahdanau's additive score and Luong's three scores.

One decoder step asks one question. The decoder state is the **query** $s \in \mathbb{R}^{D_q}$; the
encoder annotations $h_1 \dots h_T$ are the **keys** (and, by default, the **values**):

.. math::

    e_j = \mathrm{score}(s, h_j), \qquad \alpha = \mathrm{softmax}(e), \qquad c = \sum_j \alpha_j h_j

========  ============================================  ==========================
score     :math:`\mathrm{score}(s, h)`                  parameters
========  ============================================  ==========================
additive  :math:`v^\top \tanh(W_q s + W_k h)`           :math:`A (D_q + D_k + 1)`
dot       :math:`s^\top h` (needs :math:`D_q = D_k`)    0
general   :math:`s^\top W h`                            :math:`D_q D_k`
concat    :math:`v^\top \tanh(W [s; h])`                :math:`A (D_q + D_k + 1)`
========  ============================================  ==========================

(:math:`A` is the attention's hidden size.) Both modules share the signature
``forward(query (B, Dq), keys (B, T, Dk), values=None, mask=None) -> (context (B, Dv), weights (B, T))``;
``mask`` is True at valid (non-padding) positions, and a row with no valid position gets zero weights.
A query of shape (B, Tq, Dq) asks Tq questions of the same keys at once (all decoder steps of a
teacher-forced sequence) and gives ``(context (B, Tq, Dv), weights (B, Tq, T))``, as one call per
query would, without copying the keys Tq times.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _validate
from .sdpa import compute_dtype, safe_softmax

SCORES = ("dot", "general", "concat")


def _check_inputs(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None,
                  mask: torch.Tensor | None, query_size: int, key_size: int) -> torch.Tensor:
    """Validate one attention call; return the values (the keys when `values` is None)."""
    _validate.tensor("query", query, min_rank=2, floating=True)
    _validate.tensor("keys", keys, min_rank=3, floating=True)
    seen = f"query {tuple(query.shape)}, keys {tuple(keys.shape)}"
    if query.dim() not in (2, 3) or keys.dim() != 3:
        raise ValueError(f"query must be (B, Dq) or (B, Tq, Dq) and keys (B, T, Dk), got {seen}")
    if query.shape[-1] != query_size:
        raise ValueError(f"query must have size {query_size} in its last dim, got {seen}")
    if keys.shape[2] != key_size:
        raise ValueError(f"keys must have size {key_size} in their last dim, got {seen}")
    if query.shape[0] != keys.shape[0]:
        raise ValueError(f"query and keys must share the batch size, got {seen}")
    values = keys if values is None else values
    _validate.tensor("values", values, min_rank=3, floating=True)
    if values.dim() != 3 or values.shape[:2] != keys.shape[:2]:
        raise ValueError(f"values must be (B, T, Dv) with the keys' B and T, got values "
                         f"{tuple(values.shape)}, {seen}")
    if mask is not None:
        _validate.tensor("mask", mask)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = valid position), got dtype {mask.dtype}")
        if tuple(mask.shape) != tuple(keys.shape[:2]):
            raise ValueError(f"mask must be (B, T) = {tuple(keys.shape[:2])}, got shape {tuple(mask.shape)}")
    return values


def _rows(query: torch.Tensor) -> torch.Tensor:
    """A query as rows of questions: (B, Dq) -> (B, 1, Dq); (B, Tq, Dq) unchanged."""
    return query.unsqueeze(1) if query.dim() == 2 else query


def _unrows(x: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Undo :func:`_rows` on a result (B, Tq, ...) for a query that came in as (B, Dq)."""
    return x.squeeze(1) if query.dim() == 2 else x


def attend(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax `scores` (B, T) over the T source positions and mix `values` (B, T, Dv).

    Returns ``(context (B, Dv), weights (B, T))``. Masked positions get weight 0; a row with no
    valid position gets all-zero weights and a zero context (not NaN). Scores (B, Tq, T), one row
    per query, give ``(context (B, Tq, Dv), weights (B, Tq, T))`` with the same (B, T) mask.
    """
    rows = scores.dim() == 3
    if not rows:
        scores = scores.unsqueeze(1)  # (B, T) -> (B, 1, T)
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))  # (B, Tq, T), mask (B, 1, T)
    work = compute_dtype(scores.dtype)  # float32 for half precision, rounded once at the end
    weights = safe_softmax(scores.to(work), dim=-1)  # (B, Tq, T): over the source positions, never a size-1 axis
    context = (weights @ values.to(work)).to(values.dtype)  # (B, Tq, T) @ (B, T, Dv) -> (B, Tq, Dv)
    weights = weights.to(scores.dtype)
    return (context, weights) if rows else (context.squeeze(1), weights.squeeze(1))


class AdditiveAttention(nn.Module):
    r"""Bahdanau et al. (2015): :math:`e_j = v^\top \tanh(W_q s + W_k h_j)`.

    Args:
        query_size: :math:`D_q`, the decoder state's size.
        key_size: :math:`D_k`, the size of one encoder annotation.
        hidden_size: :math:`A`, the size of the tanh layer. Parameters: ``A * (Dq + Dk + 1)``.
    """

    def __init__(self, query_size: int, key_size: int, hidden_size: int) -> None:
        super().__init__()
        self.query_size = _validate.positive_int("query_size", query_size)
        self.key_size = _validate.positive_int("key_size", key_size)
        self.hidden_size = _validate.positive_int("hidden_size", hidden_size)
        self.query_proj = nn.Linear(query_size, hidden_size, bias=False)  # W_q
        self.key_proj = nn.Linear(key_size, hidden_size, bias=False)  # W_k
        self.v = nn.Linear(hidden_size, 1, bias=False)  # v^T

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """:math:`W_k h_j` for every key, (B, T, Dk) -> (B, T, A): the same at every decoder step."""
        return self.key_proj(keys)

    def score(self, query: torch.Tensor, keys: torch.Tensor,
              projected_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Scores (B, T) of `query` (B, Dq) against `keys` (B, T, Dk); (B, Tq, T) for (B, Tq, Dq)."""
        q = self.query_proj(_rows(query)).unsqueeze(2)  # (B, Tq, Dq) -> (B, Tq, A) -> (B, Tq, 1, A)
        k = self.project_keys(keys) if projected_keys is None else projected_keys  # (B, T, A)
        hidden = torch.tanh(q + k.unsqueeze(1))  # (B, Tq, 1, A) + (B, 1, T, A) -> (B, Tq, T, A)
        return _unrows(self.v(hidden).squeeze(-1), query)  # (B, Tq, T, 1) -> (B, Tq, T)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, *, projected_keys: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(context (B, Dv), weights (B, T))``; see the module docstring (also for a
        query (B, Tq, Dq), which gives (B, Tq, Dv) and (B, Tq, T)).

        `projected_keys`, from :meth:`project_keys` on the same keys, saves recomputing them at every
        decoder step (a decoder attends over the same annotations T times).
        """
        values = _check_inputs(query, keys, values, mask, self.query_size, self.key_size)
        return attend(self.score(query, keys, projected_keys), values, mask)

    def extra_repr(self) -> str:
        return f"query_size={self.query_size}, key_size={self.key_size}, hidden_size={self.hidden_size}"


class LuongAttention(nn.Module):
    r"""Luong et al. (2015): the ``"dot"``, ``"general"`` and ``"concat"`` scores behind one switch.

    Args:
        query_size: :math:`D_q`, the decoder state's size.
        key_size: :math:`D_k`, the size of one encoder annotation. ``"dot"`` needs ``Dq == Dk``.
        score: ``"dot"`` (:math:`s^\top h`), ``"general"`` (:math:`s^\top W h`) or
            ``"concat"`` (:math:`v^\top \tanh(W[s; h])`).
        hidden_size: the tanh layer's size for ``"concat"`` (default `key_size`); unused otherwise.
    """

    def __init__(self, query_size: int, key_size: int, score: str = "dot",
                 hidden_size: int | None = None) -> None:
        super().__init__()
        self.query_size = _validate.positive_int("query_size", query_size)
        self.key_size = _validate.positive_int("key_size", key_size)
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if score == "dot" and query_size != key_size:
            raise ValueError(
                f"score='dot' needs query_size == key_size (s^T h is only defined for equal sizes), "
                f"got query_size={query_size}, key_size={key_size}: use score='general' or 'concat'")
        self.score_name = score
        self.hidden_size = key_size if hidden_size is None else _validate.positive_int("hidden_size", hidden_size)
        if score == "general":
            self.W = nn.Linear(key_size, query_size, bias=False)  # W h: (Dk,) -> (Dq,); weight (Dq, Dk)
        elif score == "concat":
            self.W = nn.Linear(query_size + key_size, self.hidden_size, bias=False)  # W [s; h]
            self.v = nn.Linear(self.hidden_size, 1, bias=False)

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The part of the score that depends on the keys alone: :math:`W_h h_j` (B, T, A) for
        ``"concat"``; the keys themselves for ``"dot"`` and ``"general"``."""
        if self.score_name != "concat":
            return keys
        return keys @ self.W.weight[:, self.query_size:].T  # (B, T, Dk) @ (Dk, A) -> (B, T, A)

    def score(self, query: torch.Tensor, keys: torch.Tensor,
              projected_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Scores (B, T) of `query` (B, Dq) against `keys` (B, T, Dk); (B, Tq, T) for (B, Tq, Dq)."""
        q = _rows(query)  # (B, Tq, Dq), Tq = 1 for a single query
        if self.score_name == "dot":
            return _unrows(q @ keys.transpose(1, 2), query)  # (B, Tq, D) @ (B, D, T) -> (B, Tq, T)
        if self.score_name == "general":
            # s^T W h = (W^T s)^T h: project the Tq queries instead of the T keys.
            q = q @ self.W.weight  # (B, Tq, Dq) @ (Dq, Dk) -> (B, Tq, Dk)
            return _unrows(q @ keys.transpose(1, 2), query)  # (B, Tq, Dk) @ (B, Dk, T) -> (B, Tq, T)
        # concat: W [s; h] = W_s s + W_h h, with W = [W_s | W_h] split by columns (no (B, Tq, T, Dq+Dk) copy).
        w_s = self.W.weight[:, : self.query_size]  # (A, Dq)
        k = self.project_keys(keys) if projected_keys is None else projected_keys  # (B, T, A)
        hidden = torch.tanh((q @ w_s.T).unsqueeze(2) + k.unsqueeze(1))  # (B, Tq, 1, A) + (B, 1, T, A) -> (B, Tq, T, A)
        return _unrows(self.v(hidden).squeeze(-1), query)  # (B, Tq, T, 1) -> (B, Tq, T)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, *, projected_keys: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(context (B, Dv), weights (B, T))``; `projected_keys` as in AdditiveAttention."""
        values = _check_inputs(query, keys, values, mask, self.query_size, self.key_size)
        return attend(self.score(query, keys, projected_keys), values, mask)

    def extra_repr(self) -> str:
        extra = f", hidden_size={self.hidden_size}" if self.score_name == "concat" else ""
        return f"query_size={self.query_size}, key_size={self.key_size}, score={self.score_name!r}{extra}"


def score_parameter_count(score: str, query_size: int, key_size: int, hidden_size: int | None = None) -> int:
    """Number of learned parameters of one attention score (no biases), by formula.

    ``"additive"`` and ``"concat"`` need `hidden_size` (concat defaults it to `key_size`, as
    :class:`LuongAttention` does).
    """
    _validate.positive_int("query_size", query_size)
    _validate.positive_int("key_size", key_size)
    if score == "dot":
        return 0
    if score == "general":
        return query_size * key_size
    if score in ("additive", "concat"):
        if hidden_size is None:
            if score == "additive":
                raise ValueError("score='additive' needs hidden_size")
            hidden_size = key_size
        return _validate.positive_int("hidden_size", hidden_size) * (query_size + key_size + 1)
    raise ValueError(f"score must be 'additive', 'dot', 'general' or 'concat', got {score!r}")


class LocalPAttention(nn.Module):
    r"""Luong et al.'s local attention with a predicted position (local-p, their eqs. 9-10) on the general score.

    For each query (decoder state) :math:`s_t` it predicts an aligned source position
    :math:`p_t = S \cdot \sigma(v_p^\top \tanh(W_p s_t))` (eq. 9; :math:`S` is the row's source length, so
    :math:`0 \le p_t \le S`), takes the general score's softmax over the window :math:`|j - p_t| \le D` only, and
    multiplies it by a Gaussian centred on :math:`p_t` with :math:`\sigma = D / 2` (eq. 10):

    .. math:: a_t(j) = \mathrm{align}(s_t, h_j)\, \exp\!\big(-(j - p_t)^2 / 2\sigma^2\big)

    As in the paper the weights are not renormalised (they sum to at most 1); positions outside the window, and
    padding, get exactly 0; a window with no valid position gives zero weights and a zero context. The Gaussian
    passes a gradient to :math:`p_t`, which is how :math:`W_p` and :math:`v_p` learn.

    Args:
        query_size: :math:`D_q`, the decoder state's size.
        key_size: :math:`D_k`, the size of one encoder annotation.
        window: :math:`D`, the half-width of the window (Luong et al. use 10 on sentences; a positive int).
        hidden_size: the size of :math:`W_p` (default: `query_size`).

    Parameters: :math:`D_q D_k` (general) plus :math:`H (D_q + 1)` (the position predictor).
    ``forward(query (B, Dq) or (B, Tq, Dq), keys (B, T, Dk), values=None, mask=None)`` returns
    ``(context, weights)`` as the other modules here; :attr:`last_positions` holds the :math:`p_t` of the last call.
    """

    def __init__(self, query_size: int, key_size: int, window: int, hidden_size: int | None = None) -> None:
        super().__init__()
        self.query_size = _validate.positive_int("query_size", query_size)
        self.key_size = _validate.positive_int("key_size", key_size)
        self.window = _validate.positive_int("window", window)
        hidden = query_size if hidden_size is None else _validate.positive_int("hidden_size", hidden_size)
        self.W = nn.Linear(key_size, query_size, bias=False)  # general: s^T (W h)
        self.W_p = nn.Linear(query_size, hidden, bias=False)  # eq. 9
        self.v_p = nn.Linear(hidden, 1, bias=False)
        self.last_positions: torch.Tensor | None = None

    def positions(self, query: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """p_t (B, Tq) for queries (B, Tq, Dq) and source lengths (B,) (eq. 9)."""
        return lengths.to(query.dtype)[:, None] * torch.sigmoid(self.v_p(torch.tanh(self.W_p(query)))).squeeze(-1)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values = _check_inputs(query, keys, values, mask, self.query_size, self.key_size)
        q = _rows(query)  # (B, Tq, Dq)
        b, t = keys.shape[:2]
        valid = torch.ones(b, t, dtype=torch.bool, device=keys.device) if mask is None else mask  # (B, T)
        p = self.positions(q, valid.sum(-1))  # (B, Tq)
        j = torch.arange(t, device=keys.device, dtype=p.dtype)  # (T,)
        offset = j - p.unsqueeze(-1)  # (B, Tq, T)
        inside = (offset.abs() <= self.window) & valid.unsqueeze(1)  # (B, Tq, T)
        work = compute_dtype(q.dtype)
        scores = (q @ self.W(keys).transpose(1, 2)).to(work)  # (B, Tq, Dq) @ (B, Dq, T) -> (B, Tq, T)
        align = safe_softmax(scores.masked_fill(~inside, float("-inf")), dim=-1)  # softmax over the window
        sigma = self.window / 2
        weights = align * torch.exp(-offset.to(work) ** 2 / (2 * sigma**2))  # eq. 10, (B, Tq, T)
        context = (weights @ values.to(work)).to(values.dtype)  # (B, Tq, Dv)
        self.last_positions = _unrows(p.detach(), query)
        weights = weights.to(q.dtype)
        return _unrows(context, query), _unrows(weights, query)

    def extra_repr(self) -> str:
        return f"query_size={self.query_size}, key_size={self.key_size}, window={self.window}"


class FactoredGeneralAttention(nn.Module):
    r"""Luong's general score with its matrix stored as two thin factors, :math:`W = W_q^\top W_k` of rank at most
    `rank`: :math:`\mathrm{score}(s, h_j) = (W_q s)^\top (W_k h_j)`, a Transformer head's (unscaled) score.

    Parameters: ``rank * (query_size + key_size)`` instead of general's ``query_size * key_size``. Same
    ``forward(query, keys, values=None, mask=None)`` as :class:`LuongAttention`.
    """

    def __init__(self, query_size: int, key_size: int, rank: int) -> None:
        super().__init__()
        self.query_size = _validate.positive_int("query_size", query_size)
        self.key_size = _validate.positive_int("key_size", key_size)
        self.rank = _validate.positive_int("rank", rank)
        self.W_q = nn.Linear(query_size, rank, bias=False)
        self.W_k = nn.Linear(key_size, rank, bias=False)

    def score(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Scores (B, T) for `query` (B, Dq), (B, Tq, T) for (B, Tq, Dq)."""
        return _unrows(self.W_q(_rows(query)) @ self.W_k(keys).transpose(1, 2), query)  # (B,Tq,r) @ (B,r,T)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values = _check_inputs(query, keys, values, mask, self.query_size, self.key_size)
        return attend(self.score(query, keys), values, mask)


class LocalMAttention(nn.Module):
    r"""Luong et al.'s local attention with *monotonic* alignment (local-m, section 3.2) on the general score.

    The aligned position is the decoder step itself, :math:`p_t = t` (source and target assumed roughly in step);
    the weights are the general score's softmax over the window :math:`|j - t| \le D` only (eq. 7's align, no
    Gaussian: the paper adds that for local-p), 0 outside it and at padding. A query (B, Tq, Dq) holds the steps
    ``first_step, first_step + 1, ...``; a decoder running one step at a time passes its step as `first_step`
    (:class:`~attncourse.seq2seq.Seq2Seq` does). Parameters: :math:`D_q D_k` (the general score's).
    """

    monotonic = True  # the decoder must tell it the step (see Seq2Seq.readout)

    def __init__(self, query_size: int, key_size: int, window: int) -> None:
        super().__init__()
        self.query_size = _validate.positive_int("query_size", query_size)
        self.key_size = _validate.positive_int("key_size", key_size)
        self.window = _validate.positive_int("window", window)
        self.W = nn.Linear(key_size, query_size, bias=False)  # general: s^T (W h)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, first_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        values = _check_inputs(query, keys, values, mask, self.query_size, self.key_size)
        if not isinstance(first_step, int) or first_step < 0:
            raise ValueError(f"first_step must be a non-negative int (the decoder step of the first query), "
                             f"got {first_step!r}")
        q = _rows(query)  # (B, Tq, Dq)
        steps = torch.arange(first_step, first_step + q.shape[1], device=keys.device)  # (Tq,): p_t = t
        inside = (torch.arange(keys.shape[1], device=keys.device) - steps[:, None]).abs() <= self.window  # (Tq, T)
        if mask is not None:
            inside = inside & mask.unsqueeze(1)  # (B, Tq, T)
        scores = (q @ self.W(keys).transpose(1, 2)).to(compute_dtype(q.dtype))  # (B, Tq, T)
        weights = safe_softmax(scores.masked_fill(~inside, float("-inf")), dim=-1)  # softmax over the window
        context = (weights @ values.to(weights.dtype)).to(values.dtype)  # (B, Tq, Dv)
        return _unrows(context, query), _unrows(weights.to(q.dtype), query)

    def extra_repr(self) -> str:
        return f"query_size={self.query_size}, key_size={self.key_size}, window={self.window}"


class LocationAttention(nn.Module):
    r"""Luong et al.'s *location* score (section 3.1): weights from the decoder state alone,
    :math:`a_t = \mathrm{softmax}(W_a s_t)`, one learned score per source position up to `max_len`; the keys are
    not read. Positions past a row's length (padding) get weight 0 through `mask`, as in :func:`attend`.

    Args:
        query_size: :math:`D_q`, the decoder state's size.
        key_size: :math:`D_k`, the size of one annotation (checked; the score ignores the annotations).
        max_len: the longest source this module can score (the rows of :math:`W_a`).

    Parameters: :math:`D_q \cdot` `max_len` (no bias, as in the paper's formula).
    """

    def __init__(self, query_size: int, key_size: int, max_len: int) -> None:
        super().__init__()
        self.query_size = _validate.positive_int("query_size", query_size)
        self.key_size = _validate.positive_int("key_size", key_size)
        self.max_len = _validate.positive_int("max_len", max_len)
        self.W_a = nn.Linear(query_size, max_len, bias=False)  # one score per source position

    def score(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Scores (B, T) for `query` (B, Dq), (B, Tq, T) for (B, Tq, Dq); `keys` (B, T, Dk) give only T."""
        t = keys.shape[1]
        if t > self.max_len:
            raise ValueError(f"keys have {t} positions, more than max_len={self.max_len}: the location score "
                             f"has one weight row per position, got keys {tuple(keys.shape)}")
        return _unrows(self.W_a(_rows(query))[..., :t], query)  # (B, Tq, Dq) -> (B, Tq, max_len) -> (B, Tq, T)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values = _check_inputs(query, keys, values, mask, self.query_size, self.key_size)
        return attend(self.score(query, keys), values, mask)

    def extra_repr(self) -> str:
        return f"query_size={self.query_size}, key_size={self.key_size}, max_len={self.max_len}"


class MeanAttention(nn.Module):
    """No attention to learn: the context is the plain mean of the real (unmasked) annotations, the same at every
    decoder step (a control for chapter 01: the output layer reads a summary of the source at every step, but no
    step can choose what to read). Weights are ``1 / length`` at real positions, 0 at padding; no parameters."""

    def __init__(self, query_size: int, key_size: int) -> None:
        super().__init__()
        self.query_size = _validate.positive_int("query_size", query_size)
        self.key_size = _validate.positive_int("key_size", key_size)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values = _check_inputs(query, keys, values, mask, self.query_size, self.key_size)
        scores = keys.new_zeros(_rows(query).shape[:2] + keys.shape[1:2])  # (B, Tq, T): equal scores
        return attend(_unrows(scores, query), values, mask)  # softmax of equal scores: uniform over real positions

    def extra_repr(self) -> str:
        return f"query_size={self.query_size}, key_size={self.key_size}"
