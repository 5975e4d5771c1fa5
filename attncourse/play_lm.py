r"""A character GPT trained on *Coriolanus* with a context long enough for KV-cache experiments on text.

:mod:`attncourse.char_lm`'s model reads 64 characters of short sentences: nothing a cache policy decides matters at
that length. This one, ``play_lm``, is a :class:`~attncourse.gpt.GPT` of 4 pre-norm blocks, 4 heads of 16 dims,
``d = 64``, RoPE (base 10,000), trained on random windows of :data:`CONTEXT` = 256 characters of the first 90% of
*Coriolanus* (:func:`~attncourse.char_lm.shakespeare_chars`); the last 10% is held out. Three seeds are stored in
``notebooks/results/play_lm_seed{0,1,2}.pt`` (about 0.8 MB each); ``python -m attncourse.play_lm`` retrains them (a
few minutes of CPU per seed). Chapter 11 runs StreamingLLM, H2O, SnapKV and a quantised cache on it
(:mod:`attncourse.play_eval`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .char_lm import shakespeare_chars, windows
from .gpt import GPT, GPTConfig, train_lm

CONTEXT = 256  # training window, characters
STEPS = 250  # AdamW steps (train_lm: one-cycle schedule, peak learning rate 3e-3)
BATCH = 8  # windows per step
SEEDS = (0, 1, 2)
ROOT = Path(__file__).resolve().parent.parent / "notebooks"
TEXT = ROOT / "data" / "shakespeare" / "coriolanus.txt"
RESULTS = ROOT / "results"


def play_text(path: str | Path = TEXT) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(train, held_out, vocab)`` of *Coriolanus*, as :func:`~attncourse.char_lm.shakespeare_chars`."""
    return shakespeare_chars(path)


def play_lm(vocab_size: int, seed: int) -> GPT:
    """The untrained model of `seed`: 4 blocks, 4 heads, ``d = 64``, RoPE, full causal attention."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT(GPTConfig(vocab_size=vocab_size, block_size=CONTEXT, d_model=64, n_heads=4, n_layers=4,
                             position="rope"))


def train_play_lm(train: torch.Tensor, vocab_size: int, seed: int, steps: int = STEPS, verbose: bool = False
                  ) -> tuple[GPT, list[float]]:
    """Train :func:`play_lm` of `seed` on random windows of :data:`CONTEXT` characters; returns (model, losses)."""
    model = play_lm(vocab_size, seed)
    gen = torch.Generator().manual_seed(2000 + seed)
    def batch(step: int) -> torch.Tensor:
        if verbose and step % 50 == 0:
            print(f"seed {seed} step {step}", flush=True)
        return windows(train, BATCH, CONTEXT, gen)
    losses = train_lm(model, batch, steps, lr=3e-3)
    return model, losses


def weights_path(seed: int, results: str | Path = RESULTS) -> Path:
    return Path(results) / f"play_lm_seed{seed}.pt"


def load_play_lm(seed: int, vocab_size: int, results: str | Path = RESULTS) -> GPT:
    """The stored model of `seed` (eval mode). Raises FileNotFoundError naming the command that makes it."""
    path = weights_path(seed, results)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m attncourse.play_lm {seed}` to train it")
    model = play_lm(vocab_size, seed)
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


@torch.no_grad()
def held_out_loss(model: GPT, held_out: torch.Tensor, length: int = CONTEXT, n: int = 32, seed: int = 0) -> float:
    """Mean next-token loss (nats) on `n` held-out windows of `length` characters drawn with `seed`."""
    batch = windows(held_out, n, length, torch.Generator().manual_seed(seed))
    logits = model(batch[:, :-1])  # (n, length, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def main(seeds: list[int]) -> None:
    torch.set_num_threads(1)
    train, held_out, vocab = play_text()
    for seed in seeds:
        model, losses = train_play_lm(train, len(vocab), seed, verbose=True)
        torch.save(model.state_dict(), weights_path(seed))
        log = {"seed": seed, "steps": STEPS, "batch": BATCH, "context": CONTEXT, "train_loss_last50":
               sum(losses[-25:]) / 25, "held_out_loss": held_out_loss(model, held_out), "losses": losses[::5]}
        (RESULTS / f"play_lm_seed{seed}.json").write_text(json.dumps(log, indent=1))
        print(seed, log["train_loss_last50"], log["held_out_loss"], flush=True)


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or list(SEEDS))
