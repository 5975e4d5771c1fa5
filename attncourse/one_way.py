"""A one-way encoder for chapter 01's baseline, to test Sutskever et al.'s source reversal (their section 3.3).

The course's baseline reads the input both ways, so reversing its source changes nothing but which GRU reads which
way. Sutskever et al.'s encoder read one way, and reversing the source put the first words to translate closest to
the decoder's start. :class:`OneWaySeq2Seq` is the baseline (no attention) with a one-way encoder, and optionally
the source reversed, row by row, before the encoder reads it: on digit reversal, reading in order puts the first
digit to write last (next to the decoder's start), reading reversed puts it first (the whole input away).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from .seq2seq import Seq2Seq, Seq2SeqConfig


def flip_rows(src: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each row's first ``lengths[b]`` tokens in reverse order, padding kept in place: (B, S) -> (B, S)."""
    if src.dim() != 2 or lengths.shape != (src.shape[0],):
        raise ValueError(f"src must be (B, S) and lengths (B,), got src {tuple(src.shape)} and lengths "
                         f"{tuple(lengths.shape)}")
    pos = torch.arange(src.shape[1])  # (S,)
    index = torch.where(pos < lengths[:, None], lengths[:, None] - 1 - pos, pos)  # (B, S): mirror the real part
    return src.gather(1, index)


class OneWaySeq2Seq(Seq2Seq):
    """Chapter 01's baseline without attention, its encoder one GRU reading left to right (or, with
    `reverse_source`, each row's digits from last to first). The decoder's first state is
    :math:`\\tanh(W h_S + b)`, from the encoder's last state; everything else is :class:`Seq2Seq`'s."""

    def __init__(self, config: Seq2SeqConfig, reverse_source: bool = False) -> None:
        if not isinstance(reverse_source, bool):
            raise TypeError(f"reverse_source must be a bool, got {type(reverse_source).__name__}")
        super().__init__(config, None)
        c = config
        self.reverse_source = reverse_source
        self.encoder = nn.GRU(c.embed_size, c.encoder_size, batch_first=True)  # one direction
        self.bridge = nn.Linear(c.encoder_size, c.decoder_size)  # s_0 = tanh(W h_S + b)

    def encode(self, src: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Annotations (B, S, E) (unused: no attention) and the decoder's first state (B, Dd)."""
        if self.reverse_source:
            src = flip_rows(src, lengths)
        packed = pack_padded_sequence(self.embed(src), lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, h_n = self.encoder(packed)  # h_n: (1, B, E), each row's state after its last real token
        return out, torch.tanh(self.bridge(h_n[0]))


def train_one_way(seeds=(0, 1, 2), config: Seq2SeqConfig | None = None, lengths=None, n: int = 200,
                  readings=("in order", "reversed source")) -> dict[str, list[dict[int, float]]]:
    """Train :class:`OneWaySeq2Seq` read in order and with the source reversed, one model per seed (the seed sets
    the initialisation and the batches, as in :func:`~attncourse.seq2seq.run_seeds`): ``{"in order": [accuracy
    by length per seed], "reversed source": [...]}`` (the `readings` asked for), greedy decoding on `n` fresh inputs
    of each length."""
    unknown = [r for r in readings if r not in ("in order", "reversed source")]
    if unknown:
        raise ValueError(f"readings must be 'in order' or 'reversed source', got {unknown}")
    from dataclasses import replace

    from .seq2seq import accuracy_by_length, train

    config = config or Seq2SeqConfig()
    result: dict[str, list[dict[int, float]]] = {name: [] for name in readings}
    for name in readings:
        flag = name == "reversed source"
        for seed in seeds:
            c = replace(config, seed=seed)
            torch.manual_seed(seed)
            model = OneWaySeq2Seq(c, reverse_source=flag)
            train(model, c, progress=False)
            result[name].append(accuracy_by_length(model, lengths, n))
    return result
