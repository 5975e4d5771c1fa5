r"""Chapter 05: an MHA -> MLA conversion that stays absorbable at decode (partial RoPE, then a joint SVD).

An SVD latent of :math:`[W_K; W_V]` with RoPE applied after the up-projection caches like MLA but cannot fold
:math:`W^{UK}_h` into the query (the rotation sits between them). MHA2MLA (Ji et al., ACL 2025) first removes RoPE
from most frequency pairs of every head ("partial RoPE"), then factorises what is left. Here, for the character
model of :mod:`attncourse.char_lm` (4 heads of 16 dims, halves layout, 8 pairs per head):

* ``keep`` pairs of every head keep their rotation: the fastest ones, or per head the pairs with the largest
  contribution to the scores (:func:`two_norm_pairs`, MHA2MLA's 2-norm rule); their key dims are cached exactly, per
  head (``2 * keep * H`` numbers per token, MHA2MLA's per-head RoPE key rather than DeepSeek's shared one);
* the other pairs stop turning (their frequency set to 0: NoPE dims), and their key rows and all value rows share
  one latent of ``rank`` numbers, the truncated SVD of the stacked rows, so each head's :math:`W^{UK}_h` can be
  absorbed into its query.

The converted attention computes the same scores as the absorbed form (:func:`absorbed_scores`, checked in the tests).
``python -m attncourse.mla_convert`` converts and uptrains the three stored models, writing
``notebooks/results/ch05_partial_rope.json`` (a few CPU-minutes).
"""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

from . import _validate
from .gpt import lm_loss
from .mha import MultiHeadAttention
from .positions import apply_rope

# name -> (pairs kept rotated per head, latent rank, rule choosing them): cached numbers per token and layer
# = 2 * keep * 4 + rank. "fastest": pairs 0 .. keep-1 of every head; "2-norm": per head, by two_norm_pairs
VARIANTS = {"partial RoPE, 1 pair (no SVD)": (1, None, "fastest"), "partial RoPE, 4 pairs (no SVD)": (4, None, "fastest"),
            "MLA-32 from MHA (1 pair + latent 24)": (1, 24, "fastest"),
            "MLA-64 from MHA (4 pairs + latent 32)": (4, 32, "fastest"),
            "partial RoPE, 1 pair by 2-norm (no SVD)": (1, None, "2-norm"),
            "partial RoPE, 4 pairs by 2-norm (no SVD)": (4, None, "2-norm"),
            "MLA-32 by 2-norm (1 pair + latent 24)": (1, 24, "2-norm"),
            "MLA-64 by 2-norm (4 pairs + latent 32)": (4, 32, "2-norm")}
UPTRAIN_STEPS = 30  # 5% of the char model's 600 steps, as for GQA
CALIBRATION = 64  # training windows the 2-norm rule averages over (generator 3000 + seed)


def _pairs(attn: nn.Module, keep: int, pairs: torch.Tensor | None) -> torch.Tensor:
    """(H, keep) sorted pair indices kept rotated per head: `pairs` checked, or the `keep` fastest of every head."""
    half = attn.head_dim // 2
    _validate.positive_int("keep", keep)
    if keep > half:
        raise ValueError(f"keep must be at most head_dim/2 = {half}, got {keep}")
    if pairs is None:
        return torch.arange(keep).expand(attn.n_heads, keep)
    _validate.tensor("pairs", pairs, min_rank=2)
    if pairs.dtype != torch.long or pairs.shape != (attn.n_heads, keep):
        raise ValueError(f"pairs must be a long tensor of shape (n_heads, keep) = ({attn.n_heads}, {keep}), "
                         f"got {pairs.dtype} of shape {tuple(pairs.shape)}")
    out = pairs.sort(-1).values
    if (out < 0).any() or (out >= half).any() or (out[:, 1:] == out[:, :-1]).any():
        raise ValueError(f"pairs must hold distinct pair indices in [0, {half}) per head, got {pairs.tolist()}")
    return out


def pair_scores(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(H, D/2) MHA2MLA's 2-norm score of every frequency pair of every head on inputs x (B, T, d): the mean over
    tokens of the pair's query 2-norm times the mean of its key 2-norm, a bound on how much the pair can add to a
    score (a rotation keeps the norms, so the unrotated projections give them)."""
    q, k, _ = attn.project_qkv(x)                                                 # (B, H, T, D), halves layout
    half = attn.head_dim // 2
    norm = [(t[..., :half] ** 2 + t[..., half:] ** 2).sqrt().mean((0, 2)) for t in (q, k)]  # (H, D/2) each
    return norm[0] * norm[1]


def two_norm_pairs(lm: nn.Module, tokens: torch.Tensor, keep: int) -> list[torch.Tensor]:
    """Per block of the char GPT `lm`, the (H, keep) pairs of each head with the largest :func:`pair_scores` on the
    attention inputs `lm` computes for `tokens` (B, T)."""
    inputs = {}
    hooks = [b.attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
             for i, b in enumerate(lm.blocks)]
    try:
        with torch.no_grad():
            lm(tokens)
            return [_pairs(b.attn, keep, pair_scores(b.attn, inputs[i]).topk(keep, -1).indices)
                    for i, b in enumerate(lm.blocks)]
    finally:
        for hook in hooks:
            hook.remove()


class PartialRopeAttention(MultiHeadAttention):
    """A :class:`~attncourse.mha.MultiHeadAttention` whose heads rotate different pairs: ``head_inv_freq`` (H, D/2)
    holds each head's frequencies, 0 for the pairs that no longer turn."""

    def rotate(self, q: torch.Tensor, k: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(offset, offset + q.shape[-2], device=q.device)
        return tuple(torch.stack([apply_rope(t[:, h], pos, inv_freq=self.head_inv_freq[h])
                                  for h in range(t.shape[1])], 1) for t in (q, k))


def partial_rope_factors(attn: nn.Module, keep: int, rank: int | None, pairs: torch.Tensor | None = None) -> dict:
    """The factors of the conversion of one :class:`~attncourse.mha.MultiHeadAttention` with RoPE (MHA, halves
    layout) keeping `pairs` (H, keep) rotated (default: the `keep` fastest of every head): ``pairs`` (sorted),
    ``rope`` (indices of the key rows kept rotated, per head the first then the second halves), ``nope`` (the other
    key rows, ascending), and, when `rank` is given, ``down`` (rank, d), ``up_k`` (len(nope), rank), ``up_v``
    (H D, rank) with ``[W_K[nope]; W_V]`` ~ ``[up_k; up_v] @ down``."""
    if getattr(attn, "inv_freq", None) is None or attn.n_kv_heads != attn.n_heads:
        raise ValueError("attn must be a MultiHeadAttention with RoPE and as many K/V heads as query heads")
    half = attn.head_dim // 2
    pairs = _pairs(attn, keep, pairs)
    rope = torch.tensor([h * attn.head_dim + i + o for h in range(attn.n_heads) for o in (0, half)
                         for i in pairs[h].tolist()])
    nope = torch.tensor(sorted(set(range(attn.n_heads * attn.head_dim)) - set(rope.tolist())))
    out = {"pairs": pairs, "rope": rope, "nope": nope}
    if rank is not None:
        w = torch.cat([attn.k_proj.weight[nope], attn.v_proj.weight]).detach()   # (n_nope + H D, d)
        _validate.positive_int("rank", rank)
        if rank > min(w.shape):
            raise ValueError(f"rank must be at most {min(w.shape)} for these weights, got {rank}")
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        root = s[:rank].sqrt()
        out["down"] = root[:, None] * vh[:rank]                                    # (r, d): x -> cached latent
        up = u[:, :rank] * root                                                    # (n_nope + H D, r)
        out["up_k"], out["up_v"] = up[:len(nope)], up[len(nope):]
    return out


class SplitKey(nn.Module):
    """Key projection of the conversion: rows `rope` from their own exact weights, rows `nope` from the shared
    latent (``up(down(x))``), scattered back into the head layout; `down` is the value path's too."""

    def __init__(self, rope_weight: torch.Tensor, down: nn.Linear, up_k: torch.Tensor, rope: torch.Tensor,
                 nope: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        kind = {"dtype": rope_weight.dtype, "device": rope_weight.device}
        self.rope_proj = nn.Linear(rope_weight.shape[1], len(rope), bias=bias is not None, **kind)
        self.down, self.up = down, nn.Linear(up_k.shape[1], len(nope), bias=bias is not None, **kind)
        with torch.no_grad():
            self.rope_proj.weight.copy_(rope_weight)
            self.up.weight.copy_(up_k)
            if bias is not None:  # the key bias, exact (it adds a per-query constant to the scores)
                self.rope_proj.bias.copy_(bias[rope])
                self.up.bias.copy_(bias[nope])
        self.register_buffer("rope", rope, persistent=False)
        self.register_buffer("nope", nope, persistent=False)
        self.width = len(rope) + len(nope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(*x.shape[:-1], self.width)
        out[..., self.rope] = self.rope_proj(x)
        out[..., self.nope] = self.up(self.down(x))
        return out


def partial_rope_latent(attn: nn.Module, keep: int, rank: int | None, pairs: torch.Tensor | None = None) -> nn.Module:
    """A :class:`PartialRopeAttention` copy of `attn` computing the converted attention: `pairs` (H, keep) of each
    head rotated (default the `keep` fastest), the others unrotated, and (when `rank` is given) their key rows and
    the value rows through one shared latent projection (trainable as factors, so uptraining keeps its size)."""
    if attn.rope_factor != 1.0:
        raise ValueError(f"attn must have rope_factor 1 (no YaRN scaling), got {attn.rope_factor}")
    f = partial_rope_factors(attn, keep, rank, pairs)
    out = copy.deepcopy(attn)
    out.__class__ = PartialRopeAttention
    if rank is not None:
        kind = {"dtype": f["down"].dtype, "device": f["down"].device}
        down = nn.Linear(f["down"].shape[1], rank, bias=False, **kind)
        v_bias = attn.v_proj.bias
        up_v = nn.Linear(rank, f["up_v"].shape[0], bias=v_bias is not None, **kind)
        with torch.no_grad():
            down.weight.copy_(f["down"])
            up_v.weight.copy_(f["up_v"])
            if v_bias is not None:  # biases stay exact, outside the latent
                up_v.bias.copy_(v_bias)
        k_bias = None if attn.k_proj.bias is None else attn.k_proj.bias.detach()
        out.k_proj = SplitKey(attn.k_proj.weight[f["rope"]].detach(), down, f["up_k"], f["rope"], f["nope"], k_bias)
        out.v_proj = nn.Sequential(down, up_v)                                     # the same `down`: one latent
    kept = torch.zeros(attn.n_heads, attn.head_dim // 2, dtype=torch.bool)
    kept[torch.arange(attn.n_heads)[:, None], f["pairs"]] = True
    out.register_buffer("head_inv_freq", attn.inv_freq * kept, persistent=False)  # (H, D/2): NoPE pairs at 0
    return out


def absorbed_scores(attn: nn.Module, keep: int, rank: int, x: torch.Tensor,
                    pairs: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, T, T) pre-softmax scores of the conversion computed as MLA decodes: each head's query meets the cached
    latent through its absorbed ``W^UK_h`` (no key expanded), plus its rotated per-head RoPE key."""
    _validate.tensor("x", x, min_rank=3, floating=True)
    f = partial_rope_factors(attn, keep, rank, pairs)
    b, t, _ = x.shape
    h, d_h = attn.n_heads, attn.head_dim
    k_bias = torch.zeros(h * d_h, dtype=x.dtype) if attn.k_proj.bias is None else attn.k_proj.bias
    q = attn.q_proj(x).view(b, t, h, d_h).transpose(1, 2)                         # (B, H, T, D)
    latent = x @ f["down"].T                                                      # (B, T, r): the cache
    k_rope = (x @ attn.k_proj.weight[f["rope"]].T + k_bias[f["rope"]]).view(b, t, h, 2 * keep).transpose(1, 2)
    local = torch.arange(h * d_h).view(h, d_h)
    rope_cols = f["rope"].view(h, 2 * keep) - local[:, :1]                        # (H, 2 keep): per-head dims
    nope_cols = f["nope"].view(h, d_h - 2 * keep) - local[:, :1]                  # (H, D - 2 keep)
    pick = lambda cols: q.gather(-1, cols[None, :, None].expand(b, h, t, -1))     # (B, H, T, n) of q's dims
    pos = torch.arange(t)
    q_r, k_r = (torch.stack([apply_rope(z[:, i], pos, inv_freq=attn.inv_freq[f["pairs"][i]]) for i in range(h)], 1)
                for z in (pick(rope_cols), k_rope))                               # halves layout of the kept pairs
    up_k = f["up_k"].view(h, d_h - 2 * keep, rank)                               # W^UK_h, rows in nope_cols order
    q_n = pick(nope_cols)
    q_absorbed = torch.einsum("bhtn,hnr->bhtr", q_n, up_k)                        # (B, H, T, r): W^UK_h into q
    const = (q_n * k_bias[f["nope"]].view(h, -1)[:, None]).sum(-1, keepdim=True)  # q . key bias
    scores = q_absorbed @ latent[:, None].transpose(-2, -1) + const + q_r @ k_r.transpose(-2, -1)
    return scores / math.sqrt(d_h)


def convert_lm(lm: nn.Module, keep: int, rank: int | None, pairs: list[torch.Tensor] | None = None) -> nn.Module:
    """A copy of the char GPT `lm` with every block's attention converted by :func:`partial_rope_latent`; `pairs`:
    one (H, keep) tensor per block, or None for the `keep` fastest pairs."""
    if pairs is not None and len(pairs) != len(lm.blocks):
        raise ValueError(f"pairs must hold one tensor per block ({len(lm.blocks)}), got {len(pairs)}")
    out = copy.deepcopy(lm)
    for i, block in enumerate(out.blocks):
        block.attn = partial_rope_latent(block.attn, keep, rank, None if pairs is None else pairs[i])
    return out


def calibration(text_train: torch.Tensor, seed: int) -> torch.Tensor:
    """The :data:`CALIBRATION` training windows (B, CONTEXT) the 2-norm rule of model `seed` is measured on."""
    from .char_lm import CONTEXT, windows
    return windows(text_train, CALIBRATION, CONTEXT, torch.Generator().manual_seed(3000 + seed))[:, :-1]


def convert_variant(lm: nn.Module, name: str, text_train: torch.Tensor, seed: int) -> nn.Module:
    """`lm` converted as :data:`VARIANTS` [`name`] says (the 2-norm rule measured on :func:`calibration`)."""
    keep, rank, rule = VARIANTS[name]
    pairs = two_norm_pairs(lm.eval(), calibration(text_train, seed), keep) if rule == "2-norm" else None
    return convert_lm(lm, keep, rank, pairs)


def main(out_dir: str | Path = "notebooks/results") -> dict:
    from .char_lm import char_lm, tatoeba_chars
    from .uptrain_lm import held_out, uptrain

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    text_train, text_held, vocab = tatoeba_chars(out_dir.parent / "data" / "tatoeba" / "eng-fra-5000.txt")
    stored = torch.load(out_dir / "char_lm_rope.pt", weights_only=True)
    held = held_out(text_held)
    result = {"seeds": stored["seeds"], "steps": [0, UPTRAIN_STEPS], "variants": {k: list(v) for k, v in VARIANTS.items()},
              "loss": {name: [] for name in VARIANTS}, "pairs_2norm": {1: [], 4: []}}
    for seed, state in zip(stored["seeds"], stored["state"]):
        lm = char_lm(len(vocab), seed)
        lm.load_state_dict(state)
        for keep, chosen in result["pairs_2norm"].items():  # per seed, block and head: the pairs kept
            chosen.append([p.tolist() for p in two_norm_pairs(lm.eval(), calibration(text_train, seed), keep)])
        for name in VARIANTS:
            model = convert_variant(lm, name, text_train, seed)
            with torch.no_grad():
                row = [float(lm_loss(model.eval(), held))]
            uptrain(model.train(), text_train, seed, UPTRAIN_STEPS)
            with torch.no_grad():
                row.append(float(lm_loss(model.eval(), held)))
            result["loss"][name].append(row)
            print(seed, name, [round(v, 3) for v in row], flush=True)
    (out_dir / "ch05_partial_rope.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
