"""Checks for chapter 06's context-extension exercises (solutions/06_positions_alibi.ipynb, exercises 9 and 10):
YaRN's per-pair frequencies as its released code computes them, and a passkey experiment on the lesson's stored
character models."""

from __future__ import annotations

import functools
import math
import random

import torch

from attncourse.positions import rope_inv_freq
from . import Case, exercise


def _hf_yarn_inv_freq(head_dim: int, base: float, factor: float, original_max: int, beta_fast: float = 32.0,
                      beta_slow: float = 1.0) -> torch.Tensor:
    """Hugging Face transformers' ``_compute_yarn_parameters`` (``truncate=True``, its default), transcribed: the
    second reference every case of 06-yarn-frequencies is checked against when it is built."""
    def correction_dim(n_rot):
        return (head_dim * math.log(original_max / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def yarn_reference(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0) -> torch.Tensor:
    """The course's YaRN frequencies (float32), asserted equal to the transcription of Hugging Face's."""
    got = rope_inv_freq(head_dim, base, scaling={"type": "yarn", "factor": factor, "original_max_position": original_max,
                                                 "beta_fast": beta_fast, "beta_slow": beta_slow})
    torch.testing.assert_close(got, _hf_yarn_inv_freq(head_dim, base, factor, original_max, beta_fast, beta_slow))
    return got


def _yarn_by_course(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):
    return rope_inv_freq(head_dim, base, scaling={"type": "yarn", "factor": factor, "original_max_position": original_max,
                                                  "beta_fast": beta_fast, "beta_slow": beta_slow})


def _yarn_by_scalings(head_dim, base, factor, original_max, beta_fast=32.0, beta_slow=1.0):
    from attncourse import ctx_extension
    cfg = {**ctx_extension.scalings(factor, original_max)["YaRN"], "beta_fast": beta_fast, "beta_slow": beta_slow}
    return rope_inv_freq(head_dim, base, scaling=cfg)


# the configurations: the lesson's two toys, LLaMA 2 at YaRN's s = 16 (Peng et al.), Llama 3's base, other betas,
# a head so narrow and a context so short that no pair turns beta_slow times (both corrections clipped)
YARN_CONFIGS = [(16, 10000.0, 4.0, 64, 32.0, 1.0), (32, 10000.0, 4.0, 16, 32.0, 1.0), (128, 10000.0, 16.0, 4096, 32.0, 1.0),
                (128, 500000.0, 8.0, 8192, 32.0, 1.0), (64, 1000000.0, 32.0, 4096, 16.0, 2.0), (8, 10000.0, 2.0, 64, 32.0, 1.0),
                (64, 10000.0, 4.0, 2048, 32.0, 1.0)]


@exercise("06-yarn-frequencies", "yarn_inv_freq", points=2, category="implement", allow=(), ops=(),
          forbid=("attncourse.positions.rope_inv_freq", "attncourse.positions.yarn_ramp", "attncourse.ctx_extension.scalings"),
          shortcuts=(_yarn_by_course, _yarn_by_scalings),
          prop_doc="output equality is the property: the frequencies are the whole of YaRN's by-parts rule, judged "
                   "on seven configurations and two drawn ones (head sizes 8-128, factors 2-32, bases 1e4-1e6, other "
                   "betas) against the course's rope_inv_freq and a transcription of Hugging Face's "
                   "_compute_yarn_parameters, which agree; the paper's ramp in turns, the ramp without rounding and "
                   "Llama 3.1's rule give other numbers on some of them; every course function (rope_inv_freq, yarn_ramp, the "
                   "scalings, the checker's references) is refused, and so is a verbatim copy of one. A transcription "
                   "passes: the rule is a few lines, and yarn_ramp's arithmetic retyped with other names (the copy "
                   "detector lets short formulas through) is a right answer. So the exercise is worth 2 points, for reading "
                   "the released code's rounding rule into code, not 3 for deriving it",
          hint="write down, for a pair i, how many turns it makes over original_max positions, invert that to find "
               "the (fractional) pair index that makes beta_fast turns and the one that makes beta_slow turns, round "
               "them outward to whole pairs as the released code does, and ramp linearly in the pair index between "
               "them")
def _yarn_frequencies():
    """YaRN's per-pair inverse frequencies, as its released code (and Hugging Face) compute them."""
    configs = list(YARN_CONFIGS)
    gen = torch.Generator().manual_seed(67)  # two more, drawn (a salted grader draws others)
    for _ in range(2):
        head_dim = 2 * int(torch.randint(4, 65, (1,), generator=gen))
        base = float(10 ** (4 + 2 * torch.rand(1, generator=gen).item()))
        factor = float(torch.randint(2, 33, (1,), generator=gen))
        original = int(2 ** torch.randint(5, 14, (1,), generator=gen))
        configs.append((head_dim, round(base), factor, original, 32.0, 1.0))
    return [Case(f"D={d}, base {b:g}, factor {s:g}, original {n}, betas {bf:g}/{bs:g}", (d, b, s, n, bf, bs),
                 expected=yarn_reference(d, b, s, n, bf, bs), rtol=2e-5, atol=1e-9)
            for d, b, s, n, bf, bs in configs]


# ----------------------------------------------------------------------------- exercise 10: the passkey, by parts

from attncourse.ctx_extension import PASSKEY_WEIGHTS, PLAY_TEXT as PLAY  # noqa: E402
PK_WINDOWS, PK_LENGTH, PK_FACTOR, CHAR_HEAD_DIM = 16, 256, 4, 16


@functools.lru_cache(maxsize=1)
def _passkey_setup():
    from attncourse.char_lm import shakespeare_chars
    _, held, vocab = shakespeare_chars(PLAY)
    return held, len(vocab), torch.load(PASSKEY_WEIGHTS, weights_only=True)["state"]


def by_parts_accuracy_reference(seed: int, kept: int, distance: int, window_seed: int) -> float:
    """Share of key symbols the stored base model `seed` gets right, its first `kept` pairs per head at their
    frequency and the others divided by 4, on 16 passkey windows of 256 characters drawn with `window_seed`."""
    from attncourse import ctx_extension as cx
    from attncourse.char_lm import char_lm
    held, vocab_size, states = _passkey_setup()
    model = char_lm(vocab_size + 11, 0)
    model.load_state_dict({k: v.float() for k, v in states[seed].items()})
    model.eval()
    inv_freq = rope_inv_freq(CHAR_HEAD_DIM).clone()
    inv_freq[kept:] /= PK_FACTOR
    for block in model.blocks:
        block.attn.inv_freq = inv_freq
    windows = cx.passkey_windows(held, PK_WINDOWS, PK_LENGTH, vocab_size, torch.Generator().manual_seed(window_seed),
                                 distance)
    with torch.no_grad():
        logits = cx.key_logits(model, windows)
    return (logits.argmax(-1) == windows[:, -cx.KEY_LEN:]).float().mean().item()


def _exact_share(got, expected) -> str | None:
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"expected a number (a share of key symbols), got {type(got).__name__}"
    if abs(got - expected) < 1e-6:
        return None
    return f"off by {abs(got - expected) * PK_WINDOWS * 4:.0f} key symbol(s) of {PK_WINDOWS * 4}"


@exercise("06-passkey-by-parts", "by_parts_accuracy", points=2, category="experiment",
          allow=("attncourse.char_lm.char_lm", "attncourse.char_lm.shakespeare_chars", "attncourse.gpt.GPT",
                 "attncourse.ctx_extension.passkey_windows", "attncourse.ctx_extension.key_logits",
                 "attncourse.positions.rope_inv_freq"),
          hint="load the stored weights of the seed into the lesson's character model, give every block's attention "
               "the frequencies asked for, build the windows from the held-out text with a generator seeded with "
               "window_seed, and count the key symbols the model's most likely continuation gets right")
def _passkey_by_parts():
    """PI on every pair but the fastest few: how many must keep their frequency for the key to be found?"""
    # the window seeds are drawn afresh on every call: a table of shares read off one call's feedback is no use on the
    # next, and the shares of the cases below are neither 0 nor 1, so no rule of (kept, distance) gives them
    draw = random.SystemRandom()
    grid = [(0, 0, 192), (2, 4, 192), (1, 6, 248), (0, 1, 128)]
    cases = []
    for seed, kept, distance in grid:
        window_seed = draw.randrange(10**3, 10**6)
        cases.append(Case(f"model seed {seed}, {kept} pair(s) kept, key {distance} back, windows of seed {window_seed}",
                          (seed, kept, distance, window_seed),
                          expected=by_parts_accuracy_reference(seed, kept, distance, window_seed), compare=_exact_share))
    return cases
