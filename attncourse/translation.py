"""A small real-language task for chapter 01: short English sentences to French (Tatoeba, CC-BY 2.0 FR).

The corpus is committed beside the notebooks (``notebooks/data/tatoeba/``, with its licence and source); nothing is
downloaded. Sentences are lower-cased and split into words and punctuation; the source and the target share one
vocabulary (the course's :class:`~attncourse.seq2seq.Seq2Seq` has one embedding), words seen fewer than twice in the
training pairs become ``<unk>``, and every target ends with ``<eos>``. The same model as the reversal task learns it:
only the data and the vocabulary size change.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _validate
from .seq2seq import PAD, Seq2Seq, Seq2SeqConfig, build_model, threads

CORPUS = Path(__file__).resolve().parents[1] / "notebooks" / "data" / "tatoeba" / "eng-fra-5000.txt"
SPECIALS = ("<pad>", "<sos>", "<eos>", "<unk>")  # ids 0 (= seq2seq.PAD), 1 (= seq2seq.SOS), 2, 3
EOS, UNK = 2, 3


def tokenize(sentence: str) -> list[str]:
    """Lower-cased words (apostrophes kept inside them) and punctuation marks, in order."""
    return re.findall(r"[\w']+|[^\w\s]", sentence.lower().replace("\u2019", "'"))


class Corpus(NamedTuple):
    words: list[str]  # id -> word; ids 0-3 are SPECIALS
    train: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # src (N, S), lengths (N,), tgt (N, T) with <eos>
    test: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    test_pairs: list[tuple[list[str], list[str]]]  # the test sentences as words

    def ids(self, words: list[str]) -> list[int]:
        index = {w: i for i, w in enumerate(self.words)}
        return [index.get(w, UNK) for w in words]


def _tensors(pairs, index):
    src = [[index.get(w, UNK) for w in e] for e, _ in pairs]
    tgt = [[index.get(w, UNK) for w in f] + [EOS] for _, f in pairs]
    S, T = max(map(len, src)), max(map(len, tgt))
    pad = lambda rows, n: torch.tensor([r + [PAD] * (n - len(r)) for r in rows])  # noqa: E731
    return pad(src, S), torch.tensor([len(r) for r in src]), pad(tgt, T)


def load_corpus(path: Path | str = CORPUS, test_fraction: float = 0.1, split_seed: int = 0) -> Corpus:
    """The pairs of `path` (first French translation of each English sentence), split at random into train and
    test (`test_fraction` of the pairs; the split depends only on `split_seed`)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    first: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        english, french = line.split("\t")[:2]
        first.setdefault(english, french)
    pairs = [(tokenize(e), tokenize(f)) for e, f in first.items()]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(split_seed)).tolist()
    n_test = int(len(pairs) * test_fraction)
    test, train = [pairs[i] for i in order[:n_test]], [pairs[i] for i in order[n_test:]]
    counts = Counter(w for e, f in train for w in e + f)
    words = list(SPECIALS) + sorted(w for w, n in counts.items() if n >= 2)
    index = {w: i for i, w in enumerate(words)}
    return Corpus(words, _tensors(train, index), _tensors(test, index), test)


def config_for(corpus: Corpus, **overrides) -> Seq2SeqConfig:
    """The course's model sizes with the corpus's vocabulary (``num_digits`` = words other than PAD and SOS)."""
    return Seq2SeqConfig(**{"num_digits": len(corpus.words) - 2, "steps": 400, **overrides})


def loss_on(model: Seq2Seq, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Teacher-forced cross-entropy per target word (``<eos>`` included, padding excluded)."""
    src, lengths, tgt = data
    logits, _ = model(src, lengths, tgt)
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=PAD)


def train_translation(kind: str, corpus: Corpus, config: Seq2SeqConfig) -> tuple[Seq2Seq, list[float]]:
    """A fresh model of `kind` ("none", "additive", ...) trained with Adam on random batches of the training pairs for
    ``config.steps`` steps (the seed sets the initialisation and the batches); returns it and every step's loss."""
    model = build_model(kind, config)
    gen = torch.Generator().manual_seed(config.seed + 1)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    src, lengths, tgt = corpus.train
    losses = []
    model.train()
    with threads(config.num_threads):
        for _ in range(_validate.positive_int("steps", config.steps)):
            pick = torch.randint(0, len(src), (config.batch_size,), generator=gen)
            S, T = int(lengths[pick].max()), int((tgt[pick] != PAD).sum(1).max())
            loss = loss_on(model, (src[pick, :S], lengths[pick], tgt[pick, :T]))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            opt.step()
            losses.append(loss.item())
    return model.eval(), losses


@torch.no_grad()
def translate(model: Seq2Seq, corpus: Corpus, english: list[str], max_len: int = 12
              ) -> tuple[list[str], torch.Tensor]:
    """Greedy translation of `english` (words) up to ``<eos>``: the French words and the attention weights
    (target words, source words)."""
    src = torch.tensor([corpus.ids(english)])
    logits, weights = model(src, torch.tensor([len(english)]), steps=max_len)
    out = logits.argmax(-1)[0].tolist()
    n = out.index(EOS) + 1 if EOS in out else len(out)
    return [corpus.words[i] for i in out[:n]], (weights[0, :n] if weights is not None else None)


def chrf(hypotheses: list[str], references: list[str], order: int = 6, beta: float = 2.0) -> float:
    """Corpus-level chrF (Popovic 2015): character n-grams of orders 1 to `order` with spaces removed, counts summed
    over all sentences (as sacrebleu counts), an F-score with recall weighted `beta` times precision for each order,
    averaged over the orders that have n-grams on both sides; 0-100. sacrebleu's default instead takes one F-score of
    the precision and recall averaged over the orders: the same when each order's precision equals its recall."""
    if len(hypotheses) != len(references):
        raise ValueError(f"hypotheses and references must have the same length, got {len(hypotheses)} and "
                         f"{len(references)}")
    stats = [[0, 0, 0] for _ in range(_validate.positive_int("order", order))]  # per order: hyp, ref, matched
    for hyp, ref in zip(hypotheses, references):
        h, r = hyp.replace(" ", ""), ref.replace(" ", "")
        for n in range(1, order + 1):
            hc = Counter(h[i:i + n] for i in range(len(h) - n + 1))
            rc = Counter(r[i:i + n] for i in range(len(r) - n + 1))
            stats[n - 1][0] += sum(hc.values())
            stats[n - 1][1] += sum(rc.values())
            stats[n - 1][2] += sum((hc & rc).values())
    eps, b2, total, orders = 1e-16, beta**2, 0.0, 0
    for n_hyp, n_ref, n_match in stats:
        prec = n_match / n_hyp if n_hyp > 0 else eps
        rec = n_match / n_ref if n_ref > 0 else eps
        denom = b2 * prec + rec
        total += (1 + b2) * prec * rec / denom if denom > 0 else eps
        orders += n_hyp > 0 and n_ref > 0
    return 100 * total / orders if orders else 0.0


__all__ = ["CORPUS", "Corpus", "EOS", "UNK", "chrf", "load_corpus", "config_for", "loss_on", "train_translation",
           "translate", "tokenize"]
