"""A task a fixed-size bottleneck fails on, and a small GRU encoder-decoder to show it (chapters 01-02).

The task: reverse a sequence of random digits (lengths `min_len`..`max_len`). The model: a
bidirectional GRU encoder and a GRU decoder that, at each output step, may ask an attention module
(:class:`~attncourse.rnn_attention.AdditiveAttention`, :class:`~attncourse.rnn_attention.LuongAttention`,
anything with the same signature) for a context vector. The decoder's state is the **query**; the
encoder annotations are the **keys and values**. With ``attention=None`` the decoder sees only
the encoder's final states: everything must pass through one fixed-size vector.

The decoder follows Luong et al. (attention after the GRU step with the new state :math:`s_t` as the
query, no context fed back into the GRU), so that teacher-forced training runs all output steps at
once; Bahdanau et al. query with the previous state :math:`s_{t-1}` and feed the context into the
GRU, which forces a Python loop over steps. The attention scores, the subject of the chapters, are
the same either way. :class:`~attncourse.bahdanau.BahdanauSeq2Seq` (``build_model("bahdanau")``) is Bahdanau et al.'s own decoder,
loop and all, for comparison; ``build_model("local-p")`` puts Luong et al.'s local attention with a predicted
position (:class:`~attncourse.rnn_attention.LocalPAttention`) on the course's decoder, ``"local-m"`` at p_t = t.

Training batches hold sequences of one length each (drawn uniformly per batch, ``bucket=True``): no
padding, so the encoder needs no packing and the GRUs run only as many steps as the batch needs.
Evaluation (:func:`accuracy_by_length`) is per length too; mixed-length batches with padding work
everywhere (``bucket=False``).
"""

from __future__ import annotations

import io
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing import get_context
from typing import Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from . import _validate
from .rnn_attention import (AdditiveAttention, FactoredGeneralAttention, LocalMAttention, LocalPAttention,
                            LocationAttention, LuongAttention, MeanAttention)

PAD, SOS = 0, 1  # token ids; digit d is token d + 2
ATTENTIONS = ("none", "additive", "dot", "general", "concat")  # scores on the course's (Luong-style) decoder
# local-p / local-m: Luong's local attention, predicted position (weights sum to at most 1) / p_t = t;
# bahdanau: Bahdanau et al.'s own decoder (BahdanauSeq2Seq), additive score, queried with s_{t-1}
# location: Luong's score from the decoder state alone; mean: the plain mean of the annotations (a control);
# "general-rank-<r>": general with W = W_q^T W_k of rank r (FactoredGeneralAttention), a Transformer head's score
MORE_KINDS = ("local-p", "local-m", "bahdanau", "general-identity", "location", "mean")


class Batch(NamedTuple):
    src: torch.Tensor  # (B, S) digit tokens, PAD after each row's length
    lengths: torch.Tensor  # (B,) int64, between min_len and max_len
    tgt: torch.Tensor  # (B, S) the reversed digits, PAD after each row's length

    @property
    def mask(self) -> torch.Tensor:
        """(B, S) bool, True at real (non-padding) positions."""
        return self.src != PAD


@dataclass
class Seq2SeqConfig:
    """Task, model and training sizes. The defaults train a model (200 steps) in about 5 s on one idle CPU core
    (chapter 01 prints the time of each model it trains)."""

    num_digits: int = 10  # symbols to reverse; the vocabulary adds PAD and SOS
    min_len: int = 4
    max_len: int = 16  # long enough that one 64-number vector cannot hold the whole input
    embed_size: int = 32
    encoder_size: int = 32  # per direction: annotations are 2 * encoder_size wide
    decoder_size: int = 64  # = 2 * encoder_size, so Luong's "dot" score applies
    attention_size: int = 32  # hidden size of the additive / concat score
    local_window: int = 2  # local-p's and local-m's half-width D (Luong et al. use 10 on sentences; inputs here are 4-16 digits)
    maxout_size: int = 32  # bahdanau's deep output: 2 * maxout_size units, max over pairs (their l)
    batch_size: int = 64
    steps: int = 200  # optimiser steps, a fresh random batch each: enough for attention, not for the baseline
    lr: float = 5e-3  # Adam
    clip: float = 1.0  # gradient-norm clipping, the usual guard for RNNs
    bucket: bool = True  # one length per training batch: no padding, fewer GRU steps (about 2x faster)
    num_threads: int = 1  # these matrices are tiny: more threads add overhead (restored after training)
    seed: int = 0

    @classmethod
    def full(cls, **overrides) -> "Seq2SeqConfig":
        """A bigger task (longer inputs, more steps, larger batches), for runs outside the notebooks' minute."""
        return cls(**{"max_len": 24, "steps": 1000, "batch_size": 128, **overrides})

    @property
    def vocab_size(self) -> int:
        return self.num_digits + 2

    @property
    def key_size(self) -> int:
        return 2 * self.encoder_size


def reverse_batch(batch_size: int, min_len: int, max_len: int, num_digits: int = 10,
                  generator: torch.Generator | None = None, length: int | None = None) -> Batch:
    """Random digit sequences and their reversals; every row has its own length (or `length`)."""
    for name, value in (("batch_size", batch_size), ("min_len", min_len), ("max_len", max_len),
                        ("num_digits", num_digits)):
        _validate.positive_int(name, value)
    if min_len > max_len:
        raise ValueError(f"min_len must be <= max_len, got min_len={min_len}, max_len={max_len}")
    if length is not None:
        lengths = torch.full((batch_size,), _validate.positive_int("length", length))
    else:
        lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=generator)  # (B,)
    width = int(lengths.max())
    digits = torch.randint(0, num_digits, (batch_size, width), generator=generator) + 2  # (B, S)
    pos = torch.arange(width)  # (S,)
    valid = pos < lengths[:, None]  # (B, S)
    src = digits.masked_fill(~valid, PAD)
    rev_index = (lengths[:, None] - 1 - pos).clamp(min=0)  # (B, S): output t reads input len-1-t
    tgt = src.gather(1, rev_index).masked_fill(~valid, PAD)  # (B, S)
    return Batch(src, lengths, tgt)


def make_attention(kind: str, config: Seq2SeqConfig) -> nn.Module | None:
    """The attention module named `kind` (one of ATTENTIONS), sized for `config`'s model."""
    if kind == "none":
        return None
    if kind == "additive":
        return AdditiveAttention(config.decoder_size, config.key_size, config.attention_size)
    if kind in ("dot", "general", "concat"):
        return LuongAttention(config.decoder_size, config.key_size, kind, hidden_size=config.attention_size)
    if kind == "local-p":
        return LocalPAttention(config.decoder_size, config.key_size, config.local_window,
                               hidden_size=config.attention_size)
    if kind.startswith("general-rank-") and kind[13:].isdigit():  # general with W = W_q^T W_k of rank r
        return FactoredGeneralAttention(config.decoder_size, config.key_size, int(kind[13:]))
    if kind == "local-m":
        return LocalMAttention(config.decoder_size, config.key_size, config.local_window)
    if kind == "location":
        return LocationAttention(config.decoder_size, config.key_size, config.max_len)
    if kind == "mean":
        return MeanAttention(config.decoder_size, config.key_size)
    if kind == "bahdanau":
        return AdditiveAttention(config.decoder_size, config.key_size, config.attention_size)
    if kind == "general-identity":  # general with W = I at initialisation: exactly the dot score at step 0
        if config.decoder_size != config.key_size:
            raise ValueError(f"general-identity needs decoder_size == key_size, got {config.decoder_size} and "
                             f"{config.key_size}")
        attention = LuongAttention(config.decoder_size, config.key_size, "general", hidden_size=config.attention_size)
        with torch.no_grad():  # drawn as general's W (the rest of the model is general's), then set to I
            attention.W.weight.copy_(torch.eye(config.decoder_size))
        return attention
    raise ValueError(f"attention must be one of {ATTENTIONS + MORE_KINDS}, got {kind!r}")


class Seq2Seq(nn.Module):
    """Bidirectional GRU encoder, GRU decoder, optional attention (the query is the decoder state).

    At output step t the decoder GRU reads the previous token and updates its state
    :math:`s_t`; the attention module takes :math:`s_t` as the query and the annotations as keys
    and values and returns a context :math:`c_t`; the next-token logits are
    :math:`W_o [s_t; c_t]` (just :math:`W_o s_t` without attention). The context is not fed back
    into the GRU, so with teacher forcing all T steps run at once (one ``nn.GRU`` call, one
    attention call on B*T queries): that is what keeps training fast on a CPU.
    """

    def __init__(self, config: Seq2SeqConfig, attention: nn.Module | None = None) -> None:
        super().__init__()
        c = self.config = config
        self.attention = attention
        self.embed = nn.Embedding(c.vocab_size, c.embed_size, padding_idx=PAD)
        self.encoder = nn.GRU(c.embed_size, c.encoder_size, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(c.key_size, c.decoder_size)  # s_0 = tanh(W [h_fwd_last; h_bwd_first] + b)
        self.decoder = nn.GRU(c.embed_size, c.decoder_size, batch_first=True)
        self.out = nn.Linear(c.decoder_size + (c.key_size if attention is not None else 0), c.vocab_size)

    def encode(self, src: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Annotations (B, S, 2*E) (zeros at padding) and the decoder's first state (B, Dd)."""
        embedded = self.embed(src)  # (B, S, Emb)
        if bool((lengths == src.shape[1]).all()):  # no padding: nothing to pack
            annotations, h_n = self.encoder(embedded)  # (B, S, 2E); h_n: (2, B, E)
        else:  # packed, so that the backward GRU starts at each row's last real token, not on padding
            packed = pack_padded_sequence(embedded, lengths.cpu(), batch_first=True, enforce_sorted=False)
            out, h_n = self.encoder(packed)  # h_n: (2, B, E), forward's last and backward's first state
            annotations, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])  # (B, S, 2E)
        state = torch.tanh(self.bridge(torch.cat([h_n[0], h_n[1]], dim=-1)))  # (B, 2E) -> (B, Dd)
        return annotations, state

    def readout(self, states: torch.Tensor, annotations: torch.Tensor, mask: torch.Tensor, first_step: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) and weights (B, T, S) for decoder states (B, T, Dd), all T queries at once.

        The attention module gets the states as a (B, T, Dd) query, T questions about the same
        (B, S, 2E) annotations, as AdditiveAttention and LuongAttention accept.
        """
        if self.attention is None:
            return self.out(states), None
        step = {"first_step": first_step} if getattr(self.attention, "monotonic", False) else {}  # local-m: p_t = t
        context, weights = self.attention(states, annotations, mask=mask, **step)  # (B, T, 2E), (B, T, S)
        return self.out(torch.cat([states, context], dim=-1)), weights  # (B, T, Dd + 2E) -> (B, T, V)

    def forward(self, src: torch.Tensor, lengths: torch.Tensor, tgt: torch.Tensor | None = None,
                steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) and attention weights (B, T, S) (None without attention).

        With `tgt` (B, T) the decoder reads the true previous token (teacher forcing, all steps at
        once); without it, it reads its own greedy prediction, one step at a time, for `steps`
        steps (default S).
        """
        annotations, state = self.encode(src, lengths)  # (B, S, 2E), (B, Dd)
        mask = src != PAD  # (B, S)
        start = torch.full_like(src[:, :1], SOS)  # (B, 1)
        if tgt is not None:
            inputs = self.embed(torch.cat([start, tgt[:, :-1]], dim=1))  # (B, T, Emb): y_0 = SOS, y_1 ...
            states, _ = self.decoder(inputs, state[None])  # (B, T, Dd)
            return self.readout(states, annotations, mask)
        token, hidden = start, state[None]  # (B, 1), (1, B, Dd)
        logits, weights = [], []
        for t in range(steps or src.shape[1]):
            out, hidden = self.decoder(self.embed(token), hidden)  # (B, 1, Dd)
            step_logits, step_weights = self.readout(out, annotations, mask, t)  # (B, 1, V), (B, 1, S)
            logits.append(step_logits)
            weights.append(step_weights)
            token = step_logits.argmax(-1)  # (B, 1)
        stacked = torch.cat(weights, dim=1) if self.attention is not None else None  # (B, T, S)
        return torch.cat(logits, dim=1), stacked  # (B, T, V)


def build_model(attention: str, config: Seq2SeqConfig | None = None) -> Seq2Seq:
    """A freshly initialised model (seeded with ``config.seed``) using the attention named `attention` (one of
    ATTENTIONS or MORE_KINDS; "bahdanau" builds a :class:`~attncourse.bahdanau.BahdanauSeq2Seq`)."""
    config = config or Seq2SeqConfig()
    torch.manual_seed(config.seed)
    if attention == "bahdanau":
        from .bahdanau import BahdanauSeq2Seq  # it builds on Seq2Seq

        return BahdanauSeq2Seq(config)
    return Seq2Seq(config, make_attention(attention, config))


def loss_on(model: Seq2Seq, batch: Batch) -> torch.Tensor:
    """Teacher-forced cross-entropy over the non-padding target tokens."""
    logits, _ = model(batch.src, batch.lengths, batch.tgt)  # (B, S, V)
    return F.cross_entropy(logits.flatten(0, 1), batch.tgt.flatten(), ignore_index=PAD)


@contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with `n` PyTorch CPU threads, then restore the previous number."""
    before = torch.get_num_threads()
    torch.set_num_threads(_validate.positive_int("num_threads", n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(model: Seq2Seq, config: Seq2SeqConfig | None = None, *, progress: bool = True,
          desc: str = "training", after_step=None) -> list[float]:
    """Adam on fresh random batches for ``config.steps`` steps; returns the loss of every step.
    `after_step(step, model)`, if given, is called after each update (steps count from 1)."""
    from tqdm.auto import tqdm

    c = config or model.config
    gen = torch.Generator().manual_seed(c.seed + 1)
    opt = torch.optim.Adam(model.parameters(), lr=c.lr, fused=True)  # one kernel for all parameters
    model.train()
    losses: list[float] = []
    with threads(c.num_threads):
        bar = tqdm(range(c.steps), desc=desc, disable=not progress, mininterval=0.5)
        for _ in bar:
            length = int(torch.randint(c.min_len, c.max_len + 1, (), generator=gen)) if c.bucket else None
            loss = loss_on(model, reverse_batch(c.batch_size, c.min_len, c.max_len, c.num_digits, gen, length))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), c.clip)
            opt.step()
            losses.append(loss.item())
            if after_step is not None:
                after_step(len(losses), model)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    return losses


@torch.no_grad()
def accuracy_by_length(model: Seq2Seq, lengths: list[int] | range | None = None, n: int = 200,
                       seed: int = 1234) -> dict[int, float]:
    """Greedy-decoding token accuracy on `n` fresh sequences of each length (no teacher forcing)."""
    c = model.config
    lengths = range(c.min_len, c.max_len + 1) if lengths is None else lengths
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    result = {}
    with threads(c.num_threads):
        for length in lengths:
            batch = reverse_batch(n, c.min_len, c.max_len, c.num_digits, gen, length=length)
            logits, _ = model(batch.src, batch.lengths, steps=length)  # (n, L, V)
            result[int(length)] = (logits.argmax(-1) == batch.tgt).float().mean().item()
    return result


def time_per_step(model: Seq2Seq, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of one training step (forward, backward, no update) on a full-length batch."""
    c = model.config
    batch = reverse_batch(c.batch_size, c.max_len, c.max_len, c.num_digits, torch.Generator().manual_seed(0))
    times = []
    with threads(c.num_threads):
        for i in range(warmup + repeats):
            start = time.perf_counter()
            model.zero_grad()
            loss_on(model, batch).backward()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def step_time_samples(models: dict[str, Seq2Seq], repeats: int = 20, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each of `repeats` training steps (forward and backward on a batch of the model's
    ``config.batch_size`` sequences of ``config.max_len`` digits, one thread) of each model, measured in turns (one
    step of each model, then again), so that a change in the machine's load affects every model alike.

    Args:
        models: ``{name: model}``.
        repeats: timed steps per model, a positive int (after `warmup` untimed ones).

    Returns:
        ``{name: [seconds per step]}``, `repeats` values each, in the order measured.

    Raises:
        ValueError: if `repeats` is not a positive int.
    """
    batches = {name: reverse_batch(m.config.batch_size, m.config.max_len, m.config.max_len, m.config.num_digits,
                                   torch.Generator().manual_seed(0)) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    with threads(1):
        for i in range(warmup + _validate.positive_int("repeats", repeats)):
            for name, model in models.items():
                start = time.perf_counter()
                model.zero_grad()
                loss_on(model, batches[name]).backward()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
    return times


def step_times(models: dict[str, Seq2Seq], repeats: int = 20, warmup: int = 2) -> dict[str, float]:
    """Median seconds of one training step of each model (see :func:`step_time_samples`, which returns every
    step), measured in turns, so that a change in the machine's load affects every model alike."""
    return {name: sorted(t)[len(t) // 2] for name, t in step_time_samples(models, repeats, warmup).items()}


def count_parameters(module: nn.Module | None) -> int:
    """Trainable parameters of `module` (0 for None)."""
    return 0 if module is None else sum(p.numel() for p in module.parameters() if p.requires_grad)


class Run(NamedTuple):
    """One trained model of :func:`run_seeds`: what it is, how it learned, how well it reverses."""

    kind: str  # the attention ("none", "additive", ...)
    seed: int  # its initialisation and its training batches
    losses: list[float]  # training loss at every step
    accuracy: dict[int, float]  # greedy-decoding digit accuracy by input length
    seconds: float  # training time (one thread)
    weights: bytes  # its state_dict, saved by torch.save (see :meth:`model`)

    def model(self, config: Seq2SeqConfig) -> Seq2Seq:
        """The trained model, rebuilt (`config` as given to :func:`run_seeds`)."""
        model = build_model(self.kind, replace(config, seed=self.seed))
        model.load_state_dict(torch.load(io.BytesIO(self.weights), weights_only=True))
        return model.eval()


def _train_one(kind: str, seed: int, config: Seq2SeqConfig, lengths: list[int] | None, n: int) -> Run:
    c = replace(config, seed=seed)
    model = build_model(kind, c)
    start = time.perf_counter()
    losses = train(model, progress=False)
    seconds = time.perf_counter() - start
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return Run(kind, seed, losses, accuracy_by_length(model, lengths, n), seconds, buffer.getvalue())


def run_seeds(kinds: Sequence[str], seeds: Sequence[int] = (0, 1, 2), config: Seq2SeqConfig | None = None, *,
              lengths: list[int] | None = None, n: int = 200, workers: int = 1, progress: bool = True,
              steps: dict[str, int] | None = None) -> dict[str, list[Run]]:
    """Train a fresh model of every kind for every seed (the seed sets its initialisation and its batches) and
    measure its accuracy by length: ``{kind: [Run per seed]}``, in the order given. `steps` gives some kinds a
    training budget other than ``config.steps`` (rebuild such a model with that config: see :meth:`Run.model`).

    `workers` > 1 trains that many models at once, each in its own forked process on one thread; every model
    sees exactly what it would see alone, so the results are the same as with ``workers=1``.
    """
    config = config or Seq2SeqConfig()
    for kind in kinds:
        make_attention(kind, config)  # fail here, not in a worker, on a bad name
    configs = {kind: replace(config, steps=(steps or {}).get(kind, config.steps)) for kind in kinds}
    jobs = [(kind, seed) for kind in kinds for seed in seeds]
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc=f"{len(jobs)} models", disable=not progress)
    done: dict[tuple[str, int], Run] = {}
    if _validate.positive_int("workers", workers) == 1:
        for kind, seed in jobs:
            done[kind, seed] = _train_one(kind, seed, configs[kind], lengths, n)
            bar.update()
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            futures = {job: pool.submit(_train_one, *job, configs[job[0]], lengths, n) for job in jobs}
            for job, future in futures.items():
                done[job] = future.result()
                bar.update()
    bar.close()
    return {kind: [done[kind, seed] for seed in seeds] for kind in kinds}


def accuracy_rows(runs: list[Run], lengths: Sequence[int]) -> torch.Tensor:
    """(seeds, lengths) accuracies of `runs` (one kind, several seeds) at `lengths`."""
    return torch.tensor([[run.accuracy[n] for n in lengths] for run in runs])
