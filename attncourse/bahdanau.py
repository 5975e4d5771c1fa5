"""Bahdanau et al.'s own decoder (their section 3.1 and appendix A.2.2), for comparison with the course's
(chapter 01): the previous state asks, the context goes into the GRU, and a maxout deep output reads both."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .seq2seq import PAD, SOS, Seq2Seq, Seq2SeqConfig, make_attention


class BahdanauSeq2Seq(Seq2Seq):
    r"""Bahdanau et al.'s decoder (their section 3.1 and appendix A.2.2), at the course's sizes.

    The encoder is :class:`Seq2Seq`'s. The first state is :math:`s_0 = \tanh(W_s \overleftarrow{h}_1)` (the
    backward encoder's first state, A.2.2). At output step :math:`i`, in this order:

    * the **previous** state asks: :math:`e_{ij} = v_a^\top \tanh(W_a s_{i-1} + U_a h_j)`,
      :math:`c_i = \sum_j \alpha_{ij} h_j` (additive attention);
    * the context goes **into the GRU** with the previous token: :math:`s_i = \mathrm{GRU}([E y_{i-1}; c_i], s_{i-1})`;
    * a deep output with one maxout layer reads :math:`s_{i-1}`, :math:`y_{i-1}` and :math:`c_i`:
      :math:`\tilde t_i = U_o s_{i-1} + V_o E y_{i-1} + C_o c_i`, :math:`t_i` the max of each pair of
      :math:`\tilde t_i`'s entries, logits :math:`W_o t_i`.

    Step :math:`i` needs :math:`s_{i-1}`, so even with teacher forcing the steps run one at a time (a Python loop
    over the target): that is what the course's own decoder (Luong's arrangement) avoids. Same signature and
    outputs as :class:`Seq2Seq`: ``forward(src (B, S), lengths (B,), tgt=None, steps=None)`` returns
    ``(logits (B, T, V), weights (B, T, S))``.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config, make_attention("bahdanau", config))
        c = config
        self.bridge = nn.Linear(c.encoder_size, c.decoder_size)  # W_s (and a bias), on the backward first state
        self.decoder = nn.GRUCell(c.embed_size + c.key_size, c.decoder_size)  # input [E y_{i-1}; c_i]
        self.out_state = nn.Linear(c.decoder_size, 2 * c.maxout_size)  # U_o (with the layer's bias)
        self.out_token = nn.Linear(c.embed_size, 2 * c.maxout_size, bias=False)  # V_o
        self.out_context = nn.Linear(c.key_size, 2 * c.maxout_size, bias=False)  # C_o
        self.out = nn.Linear(c.maxout_size, c.vocab_size)  # W_o

    def encode(self, src: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Annotations (B, S, 2E) and s_0 = tanh(W_s <-h_1 + b) (B, Dd)."""
        embedded = self.embed(src)  # (B, S, Emb)
        if bool((lengths == src.shape[1]).all()):
            annotations, h_n = self.encoder(embedded)
        else:
            packed = pack_padded_sequence(embedded, lengths.cpu(), batch_first=True, enforce_sorted=False)
            out, h_n = self.encoder(packed)
            annotations, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        return annotations, torch.tanh(self.bridge(h_n[1]))  # h_n[1]: the backward GRU's state at position 1

    def step(self, token: torch.Tensor, state: torch.Tensor, annotations: torch.Tensor, mask: torch.Tensor,
             projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One output step from the previous token (B,) and state s_{i-1} (B, Dd): (logits (B, V), weights (B, S),
        s_i (B, Dd))."""
        y = self.embed(token)  # (B, Emb): E y_{i-1}
        context, weights = self.attention(state, annotations, mask=mask, projected_keys=projected)  # s_{i-1} asks
        t = self.out_state(state) + self.out_token(y) + self.out_context(context)  # (B, 2l)
        t = t.unflatten(-1, (-1, 2)).amax(-1)  # maxout over pairs: (B, l)
        new_state = self.decoder(torch.cat([y, context], dim=-1), state)  # the context goes into the GRU
        return self.out(t), weights, new_state

    def forward(self, src: torch.Tensor, lengths: torch.Tensor, tgt: torch.Tensor | None = None,
                steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        annotations, state = self.encode(src, lengths)  # (B, S, 2E), (B, Dd)
        mask = src != PAD  # (B, S)
        projected = self.attention.project_keys(annotations)  # U_a h_j, once for all steps
        token = torch.full_like(src[:, 0], SOS)  # (B,)
        n = tgt.shape[1] if tgt is not None else (steps or src.shape[1])
        logits, weights = [], []
        for i in range(n):
            step_logits, step_weights, state = self.step(token, state, annotations, mask, projected)
            logits.append(step_logits)
            weights.append(step_weights)
            token = tgt[:, i] if tgt is not None else step_logits.argmax(-1)  # teacher forcing, or greedy
        return torch.stack(logits, dim=1), torch.stack(weights, dim=1)  # (B, T, V), (B, T, S)
