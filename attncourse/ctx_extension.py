r"""Context extension where the extended context is used: a passkey in continuous text (chapter 06).

A RoPE model run past its training length ``L`` can be *not hurt* by the new positions without *using* them; on
short independent sentences the two cannot be told apart. This module measures use directly, on *Coriolanus*
(:func:`~attncourse.char_lm.shakespeare_chars`), with the passkey test of the context-extension papers (Mohtashami
and Jaggi 2023; PI and YaRN evaluate with it): a window of held-out text holds a marker followed by a key of
:data:`KEY_LEN` symbols; the window ends with the marker again, and the model must continue with the key
(:func:`passkey_windows`). The key is ``distance`` positions back. Key symbols and the marker are 11 ids added after
the text's vocabulary (:func:`extra_ids`); the key is random, so only the earlier copy can predict it.

Reading the key back needs an induction pattern: find the earlier copy of the symbol just written (the marker, then
each key symbol) and copy the one right after it, which reads relative positions. The models
(:func:`train_base`) are chapter 05's character model (:func:`~attncourse.char_lm.char_lm`: 2 blocks, 4 heads of 16
dims, RoPE base 10,000) trained on ``L = 64`` characters: next-character loss on plain text windows plus the loss on
the key in passkey windows, half a batch each (:func:`batch_loss`). :func:`fine_tune` continues the same training
after a RoPE rescaling on windows :data:`SCALE` times longer, as PI and YaRN fine-tune at the new length.
:func:`run` is the whole experiment (``FULL=1`` in lesson 06).
"""
from __future__ import annotations

import copy as _copy
from pathlib import Path

import torch
import torch.nn.functional as F

from . import _validate
from .char_lm import CONTEXT, char_lm
from .gpt import lm_loss

KEY_LEN = 4  # symbols in a key
SCALE = 4  # every rescaling is set for SCALE * L = 256 positions
DISTANCES = (32, 128, 192, 248)  # marker to marker: one inside L = 64, then 2L, 3L, almost 4L
BASE_STEPS = 600  # training at L: AdamW, batches of 16 text + 16 passkey windows
FT_CHECKPOINTS = (10, 25, 50)  # fine-tuning steps measured (PI: 1,000 steps on LLaMA; ~50 here)
FT_LR = 1e-3
TEST_WINDOWS = 32  # per distance
METHODS = ("none", "PI", "NTK", "YaRN")
_NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PLAY_TEXT = _NOTEBOOKS / "data" / "shakespeare" / "coriolanus.txt"  # the text (absolute: any working directory)
PASSKEY_WEIGHTS = _NOTEBOOKS / "results" / "ch06_passkey_text.pt"  # the stored base models of lesson 06 (FULL=1)


def extra_ids(vocab_size: int) -> tuple[torch.Tensor, int]:
    """``(key_symbols (10,), marker)``: ids after a text vocabulary of `vocab_size`; the model needs
    ``vocab_size + 11`` ids."""
    _validate.positive_int("vocab_size", vocab_size)
    return torch.arange(vocab_size, vocab_size + 10), vocab_size + 10


def scalings(scale: int = SCALE, original: int = CONTEXT) -> dict:
    """The rescalings compared, as ``rope_scaling`` dicts of :func:`~attncourse.positions.rope_inv_freq`."""
    return {"none": None, "PI": {"type": "linear", "factor": scale}, "NTK": {"type": "ntk", "factor": scale},
            "YaRN": {"type": "yarn", "factor": scale, "original_max_position": original}}


def passkey_windows(data: torch.Tensor, n: int, length: int, vocab_size: int, gen: torch.Generator,
                    distance: int | None = None) -> torch.Tensor:
    """``(n, length + 1)`` ids: text windows of `data` with ``marker, key`` at ``length - KEY_LEN - distance`` and
    ``marker, key`` again at the end (the last ``KEY_LEN`` ids are the targets). `distance` (marker to marker)
    is drawn per window from those that fit when None."""
    _validate.positive_int("n", n)
    _validate.positive_int("length", length)
    q = length - KEY_LEN                                                      # the final marker's index
    if distance is not None and not KEY_LEN < int(distance) <= q:
        raise ValueError(f"distance must be in ({KEY_LEN}, length - {KEY_LEN} = {q}], got {distance}")
    if data.dim() != 1 or len(data) <= length + 1:
        raise ValueError(f"data must be 1-D and longer than length + 1 = {length + 1}, got shape {tuple(data.shape)}")
    if int(data.max()) >= vocab_size:
        raise ValueError(f"data holds ids up to {int(data.max())}, not below vocab_size={vocab_size}")
    symbols, marker = extra_ids(vocab_size)
    starts = torch.randint(0, len(data) - length - 1, (n,), generator=gen)
    x = torch.stack([data[s:s + length + 1] for s in starts.tolist()])      # (n, length + 1)
    keys = symbols[torch.randint(0, 10, (n, KEY_LEN), generator=gen)]        # (n, KEY_LEN)
    for b in range(n):
        d = int(distance) if distance is not None else int(torch.randint(KEY_LEN + 1, q + 1, (1,), generator=gen))
        x[b, q - d], x[b, q - d + 1:q - d + 1 + KEY_LEN] = marker, keys[b]
        x[b, q], x[b, q + 1:] = marker, keys[b]
    return x


def key_logits(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """(n, KEY_LEN, V) logits for the key's symbols after the final marker."""
    return model(windows[:, :-1])[:, -KEY_LEN:]


def batch_loss(model: torch.nn.Module, text: torch.Tensor, length: int, vocab_size: int, gen: torch.Generator,
               batch: int = 16) -> torch.Tensor:
    """Next-character loss on `batch` text windows plus the key loss on `batch` passkey windows, of `length`."""
    starts = torch.randint(0, len(text) - length - 1, (batch,), generator=gen)
    plain = torch.stack([text[s:s + length + 1] for s in starts.tolist()])  # (batch, length + 1)
    keyed = passkey_windows(text, batch, length, vocab_size, gen)            # (batch, length + 1)
    logits = key_logits(model, keyed)                                        # (batch, KEY_LEN, V)
    return lm_loss(model, plain) + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), keyed[:, -KEY_LEN:].reshape(-1))


def _train(model, text, vocab_size, gen, steps, length, batch, lr, warmup, checkpoints=(), measure=None) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
    out = {}
    for step in range(1, steps + 1):
        model.train()
        loss = batch_loss(model, text, length, vocab_size, gen, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step in checkpoints:
            model.eval()
            out[step] = measure(model)
    model.eval()
    return out


def train_base(text: torch.Tensor, vocab_size: int, seed: int, steps: int = BASE_STEPS) -> torch.nn.Module:
    """:func:`~attncourse.char_lm.char_lm` (``vocab_size + 11`` ids) of `seed`, trained `steps` steps at L = 64
    (AdamW, learning rate 3e-3 after 20 warm-up steps); weights rounded to float16 and back, as stored."""
    model = char_lm(vocab_size + 11, seed)
    _train(model, text, vocab_size, torch.Generator().manual_seed(3000 + seed), steps, CONTEXT, 16, 3e-3, 20)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model.eval()


def fine_tune(model: torch.nn.Module, text: torch.Tensor, vocab_size: int, seed: int, measure,
              checkpoints=FT_CHECKPOINTS) -> dict:
    """Continue training `model` in place at ``SCALE * L`` (8 + 8 windows, AdamW at ``FT_LR`` after 5 warm-up
    steps); returns ``{steps: measure(model)}`` at each of `checkpoints`."""
    if not callable(measure):
        raise TypeError(f"measure must be a function of the model, got {type(measure).__name__}")
    return _train(model, text, vocab_size, torch.Generator().manual_seed(4000 + seed), max(checkpoints),
                  SCALE * CONTEXT, 8, FT_LR, 5, checkpoints, measure)


def test_sets(held_out: torch.Tensor, vocab_size: int, distances=DISTANCES, n: int = TEST_WINDOWS) -> dict:
    """``{distance: windows (n, SCALE * L + 1)}``, the same for every model, plus ``"text"``: 32 plain windows."""
    length = SCALE * CONTEXT
    sets = {d: passkey_windows(held_out, n, length, vocab_size, torch.Generator().manual_seed(10_000 + d), d)
            for d in distances}
    gen = torch.Generator().manual_seed(9)
    starts = torch.randint(0, len(held_out) - length - 1, (32,), generator=gen)
    sets["text"] = torch.stack([held_out[s:s + length + 1] for s in starts.tolist()])
    return sets


@torch.no_grad()
def measure(model: torch.nn.Module, sets: dict) -> dict:
    """Key loss (nats per symbol) and accuracy (share of key symbols right) per distance, and the plain text's
    loss in the first and the last L positions of a SCALE * L window."""
    out = {"key_loss": [], "key_acc": []}
    for d in (k for k in sets if k != "text"):
        logits, target = key_logits(model, sets[d]), sets[d][:, -KEY_LEN:]
        out["key_loss"].append(round(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).item(), 4))
        out["key_acc"].append(round((logits.argmax(-1) == target).float().mean().item(), 4))
    text = sets["text"]
    per = F.cross_entropy(model(text[:, :-1]).transpose(1, 2), text[:, 1:], reduction="none").mean(0)   # (T,)
    out["text_first_L"], out["text_last_L"] = round(per[:CONTEXT].mean().item(), 4), round(per[-CONTEXT:].mean().item(), 4)
    return out


def run(text: torch.Tensor, held_out: torch.Tensor, vocab_size: int, seed: int, steps: int = BASE_STEPS,
        checkpoints=FT_CHECKPOINTS) -> tuple[dict, dict]:
    """One seed of the experiment: train at L, then each rescaling zero-shot and fine-tuned. Returns
    ``(results, state)``: ``results[method][stage]`` as :func:`measure` returns it, and the base model's weights in
    float16."""
    sets = test_sets(held_out, vocab_size)
    base = train_base(text, vocab_size, seed, steps)
    state = {k: v.half() for k, v in base.state_dict().items()}
    results = {}
    for name, scaling in scalings().items():
        model = _copy.deepcopy(base)
        model.set_rope_scaling(scaling)
        row = {"zero-shot": measure(model, sets)}
        for s, m in fine_tune(model, text, vocab_size, seed, lambda mm: measure(mm, sets), checkpoints).items():
            row[f"{s} steps"] = m
        results[name] = row
    return results, state


ABF_BASE = 1_000_000.0  # "raise the base, then fine-tune" (Xiong et al. 2023; Code Llama: 10,000 -> 1,000,000)


def set_base(model: torch.nn.Module, base: float) -> torch.nn.Module:
    """Give every block's RoPE the frequencies of `base` (no rescaling, no logit factor): ABF's change."""
    for block in model.blocks:
        block.attn.set_rope(base)
    return model


def run_abf(text: torch.Tensor, held_out: torch.Tensor, vocab_size: int, seed: int, state: dict,
            base: float = ABF_BASE, checkpoints=FT_CHECKPOINTS) -> dict:
    """ABF on a stored base model (`state`, as :func:`run` returns it): the base raised to `base`, measured
    zero-shot and fine-tuned exactly as the rescalings of :func:`run` are; ``{stage: measure(...)}``."""
    sets = test_sets(held_out, vocab_size)
    model = char_lm(vocab_size + 11, 0)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    set_base(model.eval(), base)
    row = {"zero-shot": measure(model, sets)}
    for s, m in fine_tune(model, text, vocab_size, seed, lambda mm: measure(mm, sets), checkpoints).items():
        row[f"{s} steps"] = m
    return row


def store(per_seed: dict, states: dict, json_path, weights_path) -> dict:
    """Write the results of :func:`run` for several seeds (``{seed: results}``) as JSON, with the setup, and the
    base models' float16 weights (``{seed: state}``); returns what was written to JSON."""
    import json
    from pathlib import Path

    seeds = sorted(per_seed)
    stages = list(per_seed[seeds[0]]["none"])
    out = {"seeds": seeds, "context": CONTEXT, "scale": SCALE, "key_len": KEY_LEN, "distances": list(DISTANCES),
           "base_steps": BASE_STEPS, "fine_tune": {"steps": list(FT_CHECKPOINTS), "lr": FT_LR, "windows": "8 + 8",
                                                  "length": SCALE * CONTEXT},
           "stages": stages, "test_windows": TEST_WINDOWS,
           "results": {m: {s: {k: [per_seed[seed][m][s][k] for seed in seeds] for k in per_seed[seeds[0]][m][s]}
                           for s in stages} for m in METHODS}}
    Path(json_path).write_text(json.dumps(out, indent=1) + "\n")
    torch.save({"seeds": seeds, "state": [states[s] for s in seeds]}, weights_path)
    return out


if __name__ == "__main__":  # one seed: python -m attncourse.ctx_extension SEED OUT.pt (the lesson merges with store)
    import sys

    from .char_lm import shakespeare_chars

    torch.set_num_threads(1)
    train, held, vocab = shakespeare_chars(sys.argv[3] if len(sys.argv) > 3 else
                                           "notebooks/data/shakespeare/coriolanus.txt")
    res, st = run(train, held, len(vocab), int(sys.argv[1]))
    torch.save({"results": res, "state": st}, sys.argv[2])
