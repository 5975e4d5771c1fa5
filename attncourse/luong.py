"""Luong et al.'s full decoder (their section 3 and 3.3): the attentional layer and input feeding (chapter 02).

The course's :class:`~attncourse.seq2seq.Seq2Seq` reads its logits from :math:`[s_t; c_t]` and feeds nothing back
into the GRU, so teacher forcing runs all steps at once. Luong et al. (EMNLP 2015) instead compute the
**attentional hidden state** :math:`\\tilde h_t = \\tanh(W_c [c_t; s_t])` (their eq. 5), read the logits from it
(eq. 6), and, with **input feeding** (section 3.3), concatenate :math:`\\tilde h_{t-1}` with the next input, so that the
decoder knows where it attended before. That makes every step depend on the previous one's attention: a loop.
"""

from __future__ import annotations

import torch
from torch import nn

from .seq2seq import PAD, SOS, Seq2Seq, Seq2SeqConfig, make_attention


class LuongSeq2Seq(Seq2Seq):
    r"""Luong et al.'s global-attention decoder with the attentional layer and, optionally, input feeding.

    Encoder and first state as :class:`Seq2Seq`. At output step :math:`t`:
    :math:`s_t = \mathrm{GRU}([E y_{t-1}; \tilde h_{t-1}], s_{t-1})` (:math:`[E y_{t-1}]` alone without input
    feeding; :math:`\tilde h_0 = 0`), :math:`c_t, a_t` = attention with query :math:`s_t`,
    :math:`\tilde h_t = \tanh(W_c [c_t; s_t])`, logits :math:`W_s \tilde h_t`. ``forward`` has
    :class:`Seq2Seq`'s signature and outputs.
    """

    def __init__(self, config: Seq2SeqConfig, score: str = "general", input_feeding: bool = True) -> None:
        if not isinstance(input_feeding, bool):
            raise TypeError(f"input_feeding must be a bool, got {type(input_feeding).__name__}")
        if score not in ("dot", "general", "concat"):
            raise ValueError(f"score must be 'dot', 'general' or 'concat', got {score!r}")
        super().__init__(config, make_attention(score, config))
        c = config
        self.input_feeding = input_feeding
        self.decoder = nn.GRUCell(c.embed_size + (c.decoder_size if input_feeding else 0), c.decoder_size)
        self.combine = nn.Linear(c.key_size + c.decoder_size, c.decoder_size, bias=False)  # W_c (eq. 5)
        self.out = nn.Linear(c.decoder_size, c.vocab_size)  # W_s (eq. 6, with a bias)

    def step(self, token: torch.Tensor, state: torch.Tensor, feed: torch.Tensor, annotations: torch.Tensor,
             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """From y_{t-1} (B,), s_{t-1} (B, Dd) and h~_{t-1} (B, Dd): logits (B, V), weights (B, S), s_t, h~_t."""
        y = self.embed(token)  # (B, Emb)
        state = self.decoder(torch.cat([y, feed], dim=-1) if self.input_feeding else y, state)  # s_t
        context, weights = self.attention(state, annotations, mask=mask)  # (B, 2E), (B, S): s_t asks
        attentional = torch.tanh(self.combine(torch.cat([context, state], dim=-1)))  # h~_t (B, Dd)
        return self.out(attentional), weights, state, attentional

    def forward(self, src: torch.Tensor, lengths: torch.Tensor, tgt: torch.Tensor | None = None,
                steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        annotations, state = self.encode(src, lengths)  # (B, S, 2E), (B, Dd)
        mask = src != PAD  # (B, S)
        feed = state.new_zeros(state.shape)  # h~_0 = 0
        token = torch.full_like(src[:, 0], SOS)  # (B,)
        n = tgt.shape[1] if tgt is not None else (steps or src.shape[1])
        logits, weights = [], []
        for t in range(n):
            step_logits, step_weights, state, feed = self.step(token, state, feed, annotations, mask)
            logits.append(step_logits)
            weights.append(step_weights)
            token = tgt[:, t] if tgt is not None else step_logits.argmax(-1)  # teacher forcing, or greedy
        return torch.stack(logits, dim=1), torch.stack(weights, dim=1)  # (B, T, V), (B, T, S)


def train_input_feeding(input_feeding: bool, seed: int, config: Seq2SeqConfig | None = None,
                        lengths: list[int] | None = None, n: int = 200, score: str = "general") -> list[float]:
    """Train a :class:`LuongSeq2Seq` with `score` (with or without input feeding; `seed` sets its initialisation
    and its batches) and return its greedy digit accuracy at each of `lengths` (default min_len..max_len)."""
    from dataclasses import replace

    from .seq2seq import accuracy_by_length, train

    c = replace(config or Seq2SeqConfig(batch_size=32), seed=seed)
    torch.manual_seed(seed)
    model = LuongSeq2Seq(c, score, input_feeding=input_feeding)
    train(model, progress=False)
    return list(accuracy_by_length(model, lengths, n).values())
