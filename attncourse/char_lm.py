r"""A small character-level RoPE language model on real text, the course's stand-in for a pretrained checkpoint.

The course runs offline, so no pretrained model is downloaded. Chapters 05 and 06 instead use a tiny
:class:`~attncourse.gpt.GPT` (2 pre-norm blocks, 4 heads of 16 dims, RoPE, ``d = 64``) trained on the English and
French sentences of the Tatoeba sample in ``notebooks/data/tatoeba`` (CC-BY 2.0 FR), one character per token, on
windows of :data:`CONTEXT` characters. The weights of three seeds are stored in ``notebooks/results`` and loaded by
the lessons; :func:`train_char_lm` retrains one (a few minutes of CPU).

Every tenth sentence pair is held out for evaluation (:func:`tatoeba_chars`), so the held-out text is pairs not
trained on, of every length, not the tail of the file (which is sorted by length); an English sentence with several
French translations can appear on both sides.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import _validate
from .gpt import GPT, GPTConfig, train_lm

CONTEXT = 64  # training window, characters
STEPS = 600  # AdamW steps of batch 32 (train_lm: one-cycle schedule, peak learning rate 3e-3)


def tatoeba_chars(path: str | Path, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(train, held_out, vocab)``: the Tatoeba file's sentences (English line, then French line), in an order
    shuffled by `seed`, joined by newlines and encoded one id per character of ``vocab``; pairs ``i % 10 == 9`` of
    the file are held out."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    pairs = [line.split("\t")[:2] for line in lines if line.count("\t") >= 2]
    if not pairs:
        raise ValueError(f"path must be a Tatoeba tab-separated file (English, French, attribution), got {path}")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    parts = {0: [], 1: []}
    for i in order:
        parts[int(i % 10 == 9)].append("\n".join(pairs[i]))
    texts = ["\n".join(parts[k]) + "\n" for k in (0, 1)]
    vocab = "".join(sorted(set(texts[0]) | set(texts[1])))
    index = {c: i for i, c in enumerate(vocab)}
    train, held_out = (torch.tensor([index[c] for c in t]) for t in texts)
    return train, held_out, vocab


def shakespeare_chars(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(train, held_out, vocab)``: *Coriolanus* (``notebooks/data/shakespeare/coriolanus.txt``), one continuous text,
    encoded one id per character of ``vocab``; the first 90% for training, the last 10% held out. Unlike Tatoeba's
    short independent sentences, the text runs on for scenes, so a model can use context hundreds of characters back
    (a speaker's name, a repeated line)."""
    text = Path(path).read_text(encoding="utf-8")
    if len(text) < 1000:
        raise ValueError(f"path must be a plain-text file of at least 1,000 characters, got {len(text)} in {path}")
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text])
    split = int(0.9 * len(ids))
    return ids[:split], ids[split:], vocab


def windows(data: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``(n, length + 1)`` token windows starting at positions drawn from `gen` (inputs and next-token targets)."""
    _validate.positive_int("n", n)
    _validate.positive_int("length", length)
    if data.dim() != 1 or len(data) <= length + 1:
        raise ValueError(f"data must be 1-D and longer than length + 1 = {length + 1}, got shape {tuple(data.shape)}")
    starts = torch.randint(0, len(data) - length - 1, (n,), generator=gen)
    return torch.stack([data[s:s + length + 1] for s in starts.tolist()])


def char_lm(vocab_size: int, seed: int) -> GPT:
    """The untrained model of seed `seed`: 2 blocks, 4 heads, ``d = 64``, RoPE (base 10,000), MHA."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT(GPTConfig(vocab_size=vocab_size, block_size=CONTEXT, d_model=64, n_heads=4, n_layers=2,
                             position="rope"))


def train_char_lm(train: torch.Tensor, vocab_size: int, seed: int, steps: int = STEPS) -> tuple[GPT, list[float]]:
    """Train :func:`char_lm` of `seed` on random windows of :data:`CONTEXT` characters; returns (model, losses)."""
    model = char_lm(vocab_size, seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    losses = train_lm(model, lambda step: windows(train, 32, CONTEXT, gen), steps, lr=3e-3)
    return model, losses
