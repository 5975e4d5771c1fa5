r"""Location-aware attention (Chorowski et al. 2015, section 2.2), for chapter 01.

The score reads the previous step's weights as well as the content. The previous weights
:math:`\alpha_{i-1}` (B, S) go through :math:`k` one-dimensional filters of width :math:`r`,
:math:`f_i = F * \alpha_{i-1}` (B, S, k), and enter the additive score beside the query and the key:

.. math::

    e_{ij} = v^\top \tanh(W_q s_i + W_k h_j + U f_{ij})

With :math:`U = 0` it is Bahdanau's additive score. A filter that puts its weight one place to the left turns
"where I looked" into "one place before where I looked": the step reversal needs at every output position.
Chorowski et al. used k = 10 filters of width 201 on speech frames; inputs here are 4-16 digits, so k = 4, r = 5.

:class:`LocationAwareSeq2Seq` is the course's :class:`~attncourse.seq2seq.Seq2Seq` (the new state asks, the context
goes to the output layer) with this score. The GRU still runs once over a teacher-forced target; only the
attention loops over the output steps, because step i needs step i-1's weights. The first step reads zeros.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from . import _validate
from .rnn_attention import AdditiveAttention, _check_inputs, attend
from .seq2seq import PAD, SOS, Seq2Seq, Seq2SeqConfig, build_model


class LocationAwareAttention(AdditiveAttention):
    """Additive attention whose score also reads the previous weights through `filters` filters of width `width`
    (odd). ``forward(query (B, Dq), keys (B, S, Dk), previous (B, S), values=None, mask=None)`` returns
    ``(context (B, Dv), weights (B, S))``; one step at a time (a (B, Tq, Dq) query is refused)."""

    def __init__(self, query_size: int, key_size: int, hidden_size: int, filters: int = 4, width: int = 5) -> None:
        super().__init__(query_size, key_size, hidden_size)
        self.filters = _validate.positive_int("filters", filters)
        if _validate.positive_int("width", width) % 2 == 0:
            raise ValueError(f"width must be odd (the filter is centred on each position), got {width}")
        self.width = width
        self.conv = nn.Conv1d(1, filters, width, padding=width // 2, bias=False)  # F: k filters of width r
        self.loc_proj = nn.Linear(filters, hidden_size, bias=False)  # U

    def location_features(self, previous: torch.Tensor) -> torch.Tensor:
        """:math:`f = F * \\alpha_{i-1}`: (B, S) -> (B, S, k), zero beyond both ends."""
        return self.conv(previous.unsqueeze(1)).transpose(1, 2)  # (B, 1, S) -> (B, k, S) -> (B, S, k)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, previous: torch.Tensor,
                values: torch.Tensor | None = None, mask: torch.Tensor | None = None, *,
                projected_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values = _check_inputs(query, keys, values, mask, self.query_size, self.key_size)
        if query.dim() != 2:
            raise ValueError(f"query must be (B, Dq): one step at a time, got shape {tuple(query.shape)}")
        _validate.tensor("previous", previous, floating=True)
        if tuple(previous.shape) != tuple(keys.shape[:2]):
            raise ValueError(f"previous must be (B, S) = {tuple(keys.shape[:2])}, got shape {tuple(previous.shape)}")
        q = self.query_proj(query).unsqueeze(1)  # (B, 1, A)
        k = self.project_keys(keys) if projected_keys is None else projected_keys  # (B, S, A)
        loc = self.loc_proj(self.location_features(previous))  # (B, S, k) -> (B, S, A)
        scores = self.v(torch.tanh(q + k + loc)).squeeze(-1)  # (B, S, A) -> (B, S)
        return attend(scores, values, mask)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, filters={self.filters}, width={self.width}"


class LocationAwareSeq2Seq(Seq2Seq):
    """The course's encoder-decoder with :class:`LocationAwareAttention`; same signature and outputs as
    :class:`Seq2Seq` (``forward(src, lengths, tgt=None, steps=None) -> (logits (B, T, V), weights (B, T, S))``)."""

    def __init__(self, config: Seq2SeqConfig, filters: int = 4, width: int = 5) -> None:
        super().__init__(config, LocationAwareAttention(config.decoder_size, config.key_size, config.attention_size,
                                                        filters, width))

    def forward(self, src: torch.Tensor, lengths: torch.Tensor, tgt: torch.Tensor | None = None,
                steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        annotations, state = self.encode(src, lengths)  # (B, S, 2E), (B, Dd)
        mask = src != PAD  # (B, S)
        projected = self.attention.project_keys(annotations)  # (B, S, A), once
        previous = annotations.new_zeros(src.shape)  # (B, S): alpha_0 = 0, nothing read yet
        token, hidden = torch.full_like(src[:, :1], SOS), state[None]  # (B, 1), (1, B, Dd)
        if tgt is not None:  # teacher forcing: the GRU once over the whole target
            states, _ = self.decoder(self.embed(torch.cat([token, tgt[:, :-1]], dim=1)), hidden)  # (B, T, Dd)
        logits, weights = [], []
        for t in range(tgt.shape[1] if tgt is not None else (steps or src.shape[1])):
            if tgt is None:
                out, hidden = self.decoder(self.embed(token), hidden)  # (B, 1, Dd)
                s = out[:, 0]
            else:
                s = states[:, t]  # (B, Dd)
            context, previous = self.attention(s, annotations, previous, mask=mask, projected_keys=projected)
            logits.append(self.out(torch.cat([s, context], dim=-1)))  # (B, V)
            weights.append(previous)
            token = logits[-1].argmax(-1, keepdim=True)  # (B, 1), used only without tgt
        return torch.stack(logits, dim=1), torch.stack(weights, dim=1)  # (B, T, V), (B, T, S)


def build_location_aware(config: Seq2SeqConfig | None = None, filters: int = 4, width: int = 5
                         ) -> LocationAwareSeq2Seq:
    """A location-aware model that starts as the additive model of the same seed (``build_model("additive",
    config)``: every shared weight copied) with :math:`U = 0`, so at step 0 both compute the same function; the
    filters F are drawn from seed ``config.seed + 1000``."""
    config = config or Seq2SeqConfig()
    additive = build_model("additive", config)
    torch.manual_seed(config.seed + 1000)
    model = LocationAwareSeq2Seq(config, filters, width)
    missing, unexpected = model.load_state_dict(additive.state_dict(), strict=False)
    if sorted(missing) != ["attention.conv.weight", "attention.loc_proj.weight"] or unexpected:
        raise RuntimeError(f"unexpected state-dict difference: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        model.attention.loc_proj.weight.zero_()
    return model


def train_pair(seed: int, config: Seq2SeqConfig | None = None, lengths=None, n: int = 200) -> dict:
    """Train the additive model and its location-aware twin (same seed, batches, steps); accuracy by length of
    each, and the location-aware model's weights (state_dict)."""
    from .seq2seq import accuracy_by_length, train

    config = replace(config or Seq2SeqConfig(), seed=seed)
    out = {}
    for kind, model in (("additive", build_model("additive", config)), ("location", build_location_aware(config))):
        train(model, config, progress=False)
        out[kind] = accuracy_by_length(model, lengths, n)
        out[kind + "_state"] = model.state_dict()
    return out


__all__ = ["LocationAwareAttention", "LocationAwareSeq2Seq", "build_location_aware", "train_pair"]
