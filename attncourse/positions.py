r"""Where a token is: sinusoidal position encodings (Vaswani et al.), ALiBi biases (Press et al.) and
rotary position embeddings, RoPE (Su et al.), with the context-extension rescalings of RoPE.

Attention is permutation-equivariant, so order has to be added. Sinusoidal encodings add a fixed vector
per absolute position to the embeddings:

.. math:: PE_{t, 2i} = \sin(t / 10000^{2i/d}), \qquad PE_{t, 2i+1} = \cos(t / 10000^{2i/d})

ALiBi adds nothing to the embeddings; it adds a per-head linear penalty to the scores instead,
``m_h * (j - i)`` for query i and key j (negative for keys in the past), with head slopes forming a
geometric sequence. Biases here are float masks: add them to the scores (or pass them as ``attn_mask``);
combine with a causal mask yourself, e.g. through :func:`alibi_score_mod` and the masks module.

RoPE rotates each 2-D pair of query/key dims by the angle ``t * theta_i`` (``theta_i = base^(-2i/D)``), so
``q_m . k_n`` depends on positions only through ``m - n``. Two layouts exist: pairs (2i, 2i+1) as in the
paper and Meta's LLaMA code (``interleaved=True``) and halves (i, i + D/2) as in GPT-NeoX and Hugging Face
(``rotate_half``, the default); :func:`rope_permutation` maps one onto the other.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import _validate
from .masks import MaskMod

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sinusoidal_positions(seq_len: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """(T, d) table: column 2i is sin(t / base^(2i/d)), column 2i+1 is cos of the same angle."""
    _validate.positive_int("seq_len", seq_len)
    _validate.positive_int("d_model", d_model)
    if d_model % 2:
        raise ValueError(f"d_model must be even (sin/cos pairs), got {d_model}")
    t = torch.arange(seq_len, dtype=torch.float64)[:, None]  # (T, 1)
    freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d/2,)
    angle = t * freq  # (T, 1) * (d/2,) -> (T, d/2)
    pe = torch.stack([angle.sin(), angle.cos()], dim=-1)  # (T, d/2, 2): sin and cos interleaved
    return pe.reshape(seq_len, d_model).float()  # (T, d)


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)  # the first slope is 2^(-8/n); each next one is multiplied by it
    return [start ** (h + 1) for h in range(n)]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """(H,) slopes of Press et al.: 2^(-8/H), 2^(-16/H), ..., 2^(-8) when H is a power of two.

    Otherwise (their rule): take the 2^floor(log2 H) slopes of the closest smaller power of two, then
    add every other slope of the next power of two (2^(-4/p), 2^(-12/p), ... for p = 2 * closest) until
    there are H. Building only 2^floor(log2 H) slopes (as one of the notes does) leaves heads without one.
    """
    _validate.positive_int("n_heads", n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = _power_of_two_slopes(closest)
    if closest < n_heads:
        slopes += _power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias_at(slopes: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(H, Tq, Tk) bias ``slopes[h] * (k_positions[j] - q_positions[i])`` for any absolute positions.

    Rolling caches (chapter 07) keep keys whose positions are not 0..Tk-1; this is the general form.
    """
    _validate.tensor("slopes", slopes, min_rank=1, floating=True)
    for name, p in (("q_positions", q_positions), ("k_positions", k_positions)):
        _validate.tensor(name, p, min_rank=1)
        if p.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(p.shape)}")
    if slopes.dim() != 1:
        raise ValueError(f"slopes must be 1-D (H,), got shape {tuple(slopes.shape)}")
    rel = (k_positions[None, :] - q_positions[:, None]).to(slopes.dtype)  # (Tq, Tk): j - i, <= 0 in the past
    return slopes[:, None, None] * rel  # (H, 1, 1) * (Tq, Tk) -> (H, Tq, Tk)


def alibi_bias(n_heads: int, q_len: int, k_len: int | None = None) -> torch.Tensor:
    """(H, Tq, Tk) float bias ``slope_h * (j - i)``; query i sits at absolute position i + Tk - Tq.

    Queries are the *last* Tq of the Tk positions, as when decoding with a KV cache. Not masked: entries
    with j > i are positive; add a causal mask (``masks.causal_bottom_right``) yourself.
    """
    _validate.positive_int("q_len", q_len)
    k_len = q_len if k_len is None else _validate.positive_int("k_len", k_len)
    if k_len < q_len:
        raise ValueError(f"k_len must be >= q_len (queries are the last positions), got q_len={q_len}, "
                         f"k_len={k_len}")
    q_pos = torch.arange(k_len - q_len, k_len)  # (Tq,) absolute positions of the queries
    return alibi_bias_at(alibi_slopes(n_heads), q_pos, torch.arange(k_len))  # (H, Tq, Tk)


def alibi_score_mod(n_heads: int, q_offset: int = 0) -> ScoreMod:
    """FlexAttention-style ``score_mod(score, b, h, q_idx, kv_idx)`` adding the ALiBi bias.

    Query index q_idx sits at absolute position ``q_idx + q_offset`` (the cache length when decoding).
    """
    slopes = alibi_slopes(n_heads)
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"q_offset must be a non-negative int, got {q_offset!r}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes.to(score.device, score.dtype)[h] * (kv_idx - q_idx - q_offset)

    score_mod.__name__ = f"alibi_{n_heads}_heads"
    return score_mod


def materialize_bias(score_mod: ScoreMod, n_heads: int, q_len: int, k_len: int,
                     mask_mod: MaskMod | None = None) -> torch.Tensor:
    """(H, Tq, Tk) float mask: ``score_mod`` applied to zeros, ``-inf`` where ``mask_mod`` says False.

    The result goes straight into any attention's ``attn_mask`` (it broadcasts over the batch).
    """
    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable, got {type(score_mod).__name__}")
    for name, v in (("n_heads", n_heads), ("q_len", q_len), ("k_len", k_len)):
        _validate.positive_int(name, v)
    b = torch.zeros(1, 1, 1, dtype=torch.long)
    h = torch.arange(n_heads).view(-1, 1, 1)  # (H, 1, 1)
    q = torch.arange(q_len).view(1, -1, 1)  # (1, Tq, 1)
    k = torch.arange(k_len).view(1, 1, -1)  # (1, 1, Tk)
    bias = score_mod(torch.zeros(n_heads, q_len, k_len), b, h, q, k)  # (H, Tq, Tk)
    if mask_mod is not None:
        bias = bias.masked_fill(~mask_mod(b, h, q, k).expand_as(bias), float("-inf"))
    return bias


def grouped_alibi_bias(n_heads: int, n_kv_heads: int, q_len: int, k_len: int | None = None) -> torch.Tensor:
    """ALiBi for grouped scores (B, Hkv, G, Tq, Tk): the (H, Tq, Tk) bias viewed as (Hkv, G, Tq, Tk).

    Query head h = g_kv * G + r belongs to KV head g_kv (the order of ``repeat_kv``), so a plain view keeps
    each query head's own slope; the KV heads do not have slopes of their own.
    """
    _validate.positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
    bias = alibi_bias(n_heads, q_len, k_len)  # (H, Tq, Tk)
    return bias.view(n_kv_heads, n_heads // n_kv_heads, *bias.shape[1:])  # (Hkv, G, Tq, Tk)


ROPE_SCALING_KEYS = {  # type -> (required keys, optional keys with defaults)
    "linear": (("factor",), {}),
    "ntk": (("factor",), {}),
    "yarn": (("factor", "original_max_position"), {"beta_fast": 32.0, "beta_slow": 1.0}),
    "llama3": (("factor", "original_max_position"), {"low_freq_factor": 1.0, "high_freq_factor": 4.0}),
}


def check_rope_scaling(scaling: dict | None) -> dict | None:
    """Validate a RoPE scaling dict and return it with defaults filled in (None stays None)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None or a dict, got {type(scaling).__name__}")
    kind = scaling.get("type")
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"scaling['type'] must be one of {sorted(ROPE_SCALING_KEYS)}, got {kind!r}")
    required, optional = ROPE_SCALING_KEYS[kind]
    missing = [k for k in required if k not in scaling]
    unknown = sorted(set(scaling) - {"type", *required, *optional})
    if missing or unknown:
        raise ValueError(f"scaling of type {kind!r} needs keys {list(required)} (optional {sorted(optional)}); "
                         f"missing {missing}, unknown {unknown}")
    out = {"type": kind, **optional, **{k: scaling[k] for k in scaling if k != "type"}}
    for k in ("factor", "original_max_position", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
        if k in out and (isinstance(out[k], bool) or not isinstance(out[k], (int, float)) or out[k] <= 0):
            raise ValueError(f"scaling[{k!r}] must be a positive number, got {out[k]!r}")
    return out


def rope_inv_freq(head_dim: int, base: float = 10000.0, *, scaling: dict | None = None) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies ``theta_i = base^(-2i/D)``, optionally rescaled.

    scaling (the numbers of Hugging Face transformers' ``modeling_rope_utils``):

    * ``{"type": "linear", "factor": s}``: position interpolation (Chen et al. 2023), theta_i / s;
    * ``{"type": "ntk", "factor": s}``: NTK-aware, base replaced by ``base * s^(D/(D-2))``;
    * ``{"type": "yarn", "factor": s, "original_max_position": L, "beta_fast": 32, "beta_slow": 1}``:
      YaRN (Peng et al. 2023): dims that turn more than beta_fast times over L positions keep theta_i,
      dims that turn fewer than beta_slow times are interpolated (theta_i / s), a linear ramp in between.
      Pair it with :func:`rope_attention_factor`.
    * ``{"type": "llama3", "factor": s, "original_max_position": L, "low_freq_factor": 1, "high_freq_factor": 4}``:
      Llama 3.1's frequency-dependent scaling (Hugging Face ``rope_type="llama3"``; Llama 3.1 ships s = 8,
      L = 8192, base 500000): pairs whose wavelength ``2 pi / theta_i`` is shorter than ``L / high_freq_factor``
      keep theta_i, those longer than ``L / low_freq_factor`` get theta_i / s, and in between
      ``(1 - a) theta_i / s + a theta_i`` with ``a = (L / wavelength - low_freq_factor) / (high_freq_factor -
      low_freq_factor)``.

    Raises ValueError for an odd or non-positive head_dim, a base <= 1, or a malformed scaling dict (TypeError
    for a scaling that is not a dict).
    """
    _validate.positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs of dims), got {head_dim}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or base <= 1:
        raise ValueError(f"base must be a number > 1, got {base!r}")
    scaling = check_rope_scaling(scaling)
    kind = None if scaling is None else scaling["type"]
    if kind == "ntk":
        base = base * scaling["factor"] ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (D/2,)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "yarn":
        ramp = yarn_ramp(head_dim, base, scaling["original_max_position"], scaling["beta_fast"], scaling["beta_slow"])
        inv_freq = inv_freq * (1 - ramp) + inv_freq / scaling["factor"] * ramp  # ramp 0: keep theta_i, 1: theta_i / s
    elif kind == "llama3":
        s, length = scaling["factor"], scaling["original_max_position"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        if high <= low:
            raise ValueError(f"scaling['high_freq_factor']={high} must exceed scaling['low_freq_factor']={low}")
        wavelength = 2 * math.pi / inv_freq  # (D/2,) positions per turn of each pair
        a = ((length / wavelength - low) / (high - low)).clamp(0, 1)  # 1: keep (fast pairs), 0: divide by s
        inv_freq = (1 - a) * inv_freq / s + a * inv_freq
    return inv_freq


def _check_positive_numbers(**values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def yarn_ramp(head_dim: int, base: float, original_max: int, beta_fast: float = 32.0,
              beta_slow: float = 1.0) -> torch.Tensor:
    """(head_dim/2,) float32 YaRN ramp as its released code (and Hugging Face, ``truncate=True``) computes it:
    0 for the pairs that keep theta_i (more than beta_fast turns over original_max positions), 1 for those
    interpolated to theta_i / s (fewer than beta_slow turns), linear in the pair index between the two correction
    indices, rounded outward (floor, ceil) and clipped at 0 and head_dim - 1.

    Raises ValueError for an odd or non-positive head_dim, a base <= 1, a non-positive original_max or beta, or
    beta_fast <= beta_slow.
    """
    _validate.positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs of dims), got {head_dim}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or base <= 1:
        raise ValueError(f"base must be a number > 1, got {base!r}")
    _check_positive_numbers(original_max=original_max, beta_fast=beta_fast, beta_slow=beta_slow)
    if beta_slow >= beta_fast:
        raise ValueError(f"beta_slow must be below beta_fast, got beta_slow={beta_slow!r}, beta_fast={beta_fast!r}")

    def dim_for(n_turns: float) -> float:  # the dim index whose frequency turns n_turns times over original_max
        return head_dim * math.log(original_max / (n_turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    return ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (D/2,)


def rope_attention_factor(scaling: dict | None = None) -> float:
    """YaRN's factor ``0.1 ln s + 1`` (1.0 for s <= 1 and for every other scaling).

    Hugging Face multiplies cos and sin by it, i.e. q and k each, so the logits grow by its square:
    the paper's temperature ``sqrt(1/t) = 0.1 ln s + 1``.
    """
    scaling = check_rope_scaling(scaling)
    if scaling is None or scaling["type"] != "yarn" or scaling["factor"] <= 1:
        return 1.0
    return 0.1 * math.log(scaling["factor"]) + 1.0


def apply_rope(x: torch.Tensor, positions: torch.Tensor | None = None, *, base: float = 10000.0,
               interleaved: bool = False, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x (..., T, D) by its positions: every pair of dims (a, b) at position t becomes
    ``(a cos - b sin, b cos + a sin)`` of the angle ``t * theta_i``.

    positions: integer tensor broadcastable to (..., T), default ``arange(T)``. interleaved: pairs
    (2i, 2i+1) if True, halves (i, i + D/2) if False. inv_freq: (D/2,) frequencies, default
    ``rope_inv_freq(D, base)``. Angles in float32 (float64 for float64 x); returns x's shape and dtype.
    """
    _validate.tensor("x", x, min_rank=2, floating=True)
    t, d = x.shape[-2:]
    if d % 2:
        raise ValueError(f"x must have an even last dim D (RoPE rotates pairs), got shape {tuple(x.shape)}")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    if positions is None:
        positions = torch.arange(t, device=x.device)
    _validate.tensor("positions", positions, min_rank=1)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    _validate.broadcastable("positions", tuple(positions.shape), tuple(x.shape[:-1]), "x without D (..., T)")
    if inv_freq is None:  # validates base; then recomputed in float64 for float64 x
        inv_freq = rope_inv_freq(d, base)
        if cdt == torch.float64:
            inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=cdt) / d))  # (D/2,)
    _validate.tensor("inv_freq", inv_freq, min_rank=1, floating=True)
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"inv_freq must be (D/2,) = ({d // 2},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(inv_freq.shape)}")
    if interleaved:  # pairs (2i, 2i+1): the halves layout on permuted dims, permuted back (one layout, two orders)
        perm = rope_permutation(d).to(x.device)  # (D,): pairs layout -> halves layout
        return apply_rope(x[..., perm], positions, inv_freq=inv_freq)[..., torch.argsort(perm)]
    angle = positions.to(x.device, cdt)[..., None] * inv_freq.to(x.device, cdt)  # (..., T, 1) * (D/2,) -> (..., T, D/2)
    cos, sin = angle.cos(), angle.sin()
    xc = x.to(cdt)
    a, b = xc[..., : d // 2], xc[..., d // 2:]  # (..., T, D/2) each: dims i and i + D/2
    out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)  # (..., T, D)
    return out.to(x.dtype)


def rope_permutation(head_dim: int) -> torch.Tensor:
    """(D,) index ``perm`` with ``x_halves = x_pairs[..., perm]``: pair i's dims (2i, 2i+1) go to (i, i + D/2).

    Permuting the rows of W_q and W_k of a pairs-layout checkpoint this way gives a halves-layout model
    with identical attention (what Hugging Face's LLaMA conversion script does).
    """
    _validate.positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])  # (D,)


def t5_relative_bucket(relative_position: torch.Tensor, *, bidirectional: bool = True, num_buckets: int = 32,
                       max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of each relative position ``key - query`` (Raffel et al. 2020, section 2.1; the bucketing of
    Mesh TensorFlow and Hugging Face's ``T5Attention._relative_position_bucket``).

    relative_position: integer tensor of any shape, ``j - i`` for key j and query i. Returns a long tensor of the same
    shape with values in ``[0, num_buckets)``. Bidirectional (an encoder): half the buckets for keys before the
    query, half for keys after it; unidirectional (a decoder): every bucket for the past, the future maps to bucket
    0. Within a side, the first half of its buckets hold the distances 0, 1, ... exactly, and the rest cover the
    distances up to `max_distance` in logarithmically growing bins; farther distances share the last bucket.
    Raises TypeError for a non-integer tensor, ValueError for num_buckets < 4 (odd when bidirectional) or
    max_distance not above the exact range.
    """
    _validate.tensor("relative_position", relative_position, min_rank=0)
    if relative_position.is_floating_point() or relative_position.is_complex() or relative_position.dtype == torch.bool:
        raise TypeError(f"relative_position must be an integer tensor, got dtype {relative_position.dtype}")
    _validate.positive_int("num_buckets", num_buckets)
    _validate.positive_int("max_distance", max_distance)
    side = num_buckets // 2 if bidirectional else num_buckets  # buckets for one side
    if num_buckets < 4 or (bidirectional and num_buckets % 2):
        raise ValueError(f"num_buckets must be at least 4 (and even when bidirectional), got {num_buckets}")
    exact = side // 2  # distances 0 .. exact - 1 get a bucket each
    if max_distance <= exact:
        raise ValueError(f"max_distance must exceed the exact range {exact}, got {max_distance}")
    rel = relative_position.long()
    if bidirectional:
        offset = (rel > 0).long() * side  # keys after the query: the upper half of the buckets
        dist = rel.abs()
    else:
        offset = torch.zeros_like(rel)
        dist = (-rel).clamp(min=0)  # distance into the past; the future is distance 0
    # log-spaced bins from `exact` to `max_distance`, in float32 and truncated toward zero, as T5's code does
    far = exact + (torch.log(dist.clamp(min=1).float() / exact) / math.log(max_distance / exact)
                   * (side - exact)).long()
    far = far.clamp(max=side - 1)
    return offset + torch.where(dist < exact, dist, far)


class T5RelativeBias(torch.nn.Module):
    """A learned relative-position bias, one scalar per head and bucket (T5): ``bias[h, i, j] =
    table[bucket(j - i), h]``, added to the scores (T5 adds it without scaling, in every layer from the first's
    table). ``forward(q_len, k_len=None, q_offset=None)`` -> (H, Tq, Tk) float; the queries are the last Tq of the
    Tk positions by default (decoding with a cache). Raises ValueError for bad sizes."""

    def __init__(self, n_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        _validate.positive_int("n_heads", n_heads)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.table = torch.nn.Embedding(num_buckets, n_heads)  # (buckets, H)
        t5_relative_bucket(torch.zeros(1, dtype=torch.long), bidirectional=bidirectional,
                           num_buckets=num_buckets, max_distance=max_distance)  # validates the sizes

    def forward(self, q_len: int, k_len: int | None = None, q_offset: int | None = None) -> torch.Tensor:
        _validate.positive_int("q_len", q_len)
        k_len = q_len if k_len is None else _validate.positive_int("k_len", k_len)
        q_offset = k_len - q_len if q_offset is None else q_offset
        if q_offset < 0:
            raise ValueError(f"q_offset must be >= 0, got {q_offset} (q_len {q_len}, k_len {k_len})")
        dev = self.table.weight.device
        rel = torch.arange(k_len, device=dev)[None, :] - (torch.arange(q_len, device=dev)[:, None] + q_offset)
        buckets = t5_relative_bucket(rel, bidirectional=self.bidirectional, num_buckets=self.num_buckets,
                                     max_distance=self.max_distance)  # (Tq, Tk)
        return self.table(buckets).permute(2, 0, 1)  # (Tq, Tk, H) -> (H, Tq, Tk)


def apply_partial_rope(x: torch.Tensor, positions: torch.Tensor | None = None, *, rotary_dim: int,
                       base: float = 10000.0, interleaved: bool = False) -> torch.Tensor:
    """RoPE on the first `rotary_dim` dims of each head only; the other ``D - rotary_dim`` pass unchanged (GPT-NeoX's
    and Pythia's ``rotary_pct = 0.25``, Phi-2's ``partial_rotary_factor = 0.4``; DeepSeek-V2/V3 give RoPE its own 64
    dims beside 128 without it). The frequencies are those of a rotary_dim-wide RoPE, as in Hugging Face.

    x (..., T, D), positions as in :func:`apply_rope`. Returns x's shape and dtype. Raises ValueError for a
    rotary_dim that is odd, not positive or above D.
    """
    _validate.tensor("x", x, min_rank=2, floating=True)
    d = x.shape[-1]
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 0 < rotary_dim <= d or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even int in (0, D] = (0, {d}] for x of shape {tuple(x.shape)}, "
                         f"got {rotary_dim!r}")
    rotated = apply_rope(x[..., :rotary_dim], positions, base=base, interleaved=interleaved)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


if __name__ == "__main__":  # pragma: no cover - a demo that draws
    import matplotlib.pyplot as plt

    from .plot import heads_grid

    heads_grid(alibi_bias(8, 10), title="ALiBi bias per head (8 heads)", cbar_label="bias")
    plt.show()
