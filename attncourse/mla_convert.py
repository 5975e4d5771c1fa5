r"""Chapter 05: an MHA -> MLA conversion that stays absorbable at decode (partial RoPE, then a joint SVD).

An SVD latent of :math:`[W_K; W_V]` with RoPE applied after the up-projection caches like MLA but cannot fold
:math:`W^{UK}_h` into the query (the rotation sits between them). MHA2MLA (Ji et al., ACL 2025) first removes RoPE
from most frequency pairs of every head ("partial RoPE"), then factorises what is left. Here, for the character
model of :mod:`attncourse.char_lm` (4 heads of 16 dims, halves layout, 8 pairs per head):

* the ``keep`` fastest pairs of every head keep their rotation; their key dims are cached exactly, per head
  (``2 * keep * H`` numbers per token, MHA2MLA's per-head RoPE key rather than DeepSeek's shared one);
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
from .positions import apply_rope

# name -> (fastest pairs kept rotated, latent rank): cached numbers per token and layer = 2 * keep * 4 + rank
VARIANTS = {"partial RoPE, 1 pair (no SVD)": (1, None), "partial RoPE, 4 pairs (no SVD)": (4, None),
            "MLA-32 from MHA (1 pair + latent 24)": (1, 24), "MLA-64 from MHA (4 pairs + latent 32)": (4, 32)}
UPTRAIN_STEPS = 30  # 5% of the char model's 600 steps, as for GQA


def partial_rope_factors(attn: nn.Module, keep: int, rank: int | None) -> dict:
    """The factors of the conversion of one :class:`~attncourse.mha.MultiHeadAttention` with RoPE (MHA, halves
    layout): ``rope`` (indices of the key rows kept rotated), ``nope`` (the other key rows), and, when `rank` is
    given, ``down`` (rank, d), ``up_k`` (len(nope), rank), ``up_v`` (H D, rank) with ``[W_K[nope]; W_V]`` ~
    ``[up_k; up_v] @ down``."""
    if getattr(attn, "inv_freq", None) is None or attn.n_kv_heads != attn.n_heads:
        raise ValueError("attn must be a MultiHeadAttention with RoPE and as many K/V heads as query heads")
    half = attn.head_dim // 2
    _validate.positive_int("keep", keep)
    if keep > half:
        raise ValueError(f"keep must be at most head_dim/2 = {half}, got {keep}")
    rope = torch.tensor([h * attn.head_dim + i + o for h in range(attn.n_heads) for o in (0, half) for i in range(keep)])
    nope = torch.tensor(sorted(set(range(attn.n_heads * attn.head_dim)) - set(rope.tolist())))
    out = {"rope": rope, "nope": nope}
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


def partial_rope_latent(attn: nn.Module, keep: int, rank: int | None) -> nn.Module:
    """A copy of `attn` computing the converted attention: the `keep` fastest pairs of each head rotated, the others
    unrotated, and (when `rank` is given) their key rows and the value rows through one shared latent projection
    (trainable as factors, so uptraining keeps the latent's size)."""
    f = partial_rope_factors(attn, keep, rank)
    out = copy.deepcopy(attn)
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
    with torch.no_grad():
        out.inv_freq[keep:] = 0.0                                                  # NoPE dims: no rotation
    return out


def absorbed_scores(attn: nn.Module, keep: int, rank: int, x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, T) pre-softmax scores of the conversion computed as MLA decodes: each head's query meets the cached
    latent through its absorbed ``W^UK_h`` (no key expanded), plus its rotated per-head RoPE key."""
    _validate.tensor("x", x, min_rank=3, floating=True)
    f = partial_rope_factors(attn, keep, rank)
    b, t, _ = x.shape
    h, d_h = attn.n_heads, attn.head_dim
    k_bias = torch.zeros(h * d_h, dtype=x.dtype) if attn.k_proj.bias is None else attn.k_proj.bias
    q = attn.q_proj(x).view(b, t, h, d_h).transpose(1, 2)                         # (B, H, T, D)
    latent = x @ f["down"].T                                                      # (B, T, r): the cache
    k_rope = (x @ attn.k_proj.weight[f["rope"]].T + k_bias[f["rope"]]).view(b, t, h, 2 * keep).transpose(1, 2)
    local = torch.arange(h * d_h).view(h, d_h)
    rope_cols = torch.tensor([i + o for o in (0, d_h // 2) for i in range(keep)])             # per head
    nope_cols = torch.tensor(sorted(set(range(d_h)) - set(rope_cols.tolist())))
    pos = torch.arange(t)
    q_r = apply_rope(q[..., rope_cols], pos, inv_freq=attn.inv_freq[:keep])      # halves layout of the kept pairs
    k_r = apply_rope(k_rope, pos, inv_freq=attn.inv_freq[:keep])
    up_k = f["up_k"].view(h, d_h - 2 * keep, rank)                               # W^UK_h, rows in nope_cols order
    assert torch.equal(local[:, nope_cols].reshape(-1), f["nope"])
    q_absorbed = torch.einsum("bhtn,hnr->bhtr", q[..., nope_cols], up_k)          # (B, H, T, r): W^UK_h into q
    const = (q[..., nope_cols] * k_bias[f["nope"]].view(h, -1)[:, None]).sum(-1, keepdim=True)  # q . key bias
    scores = q_absorbed @ latent[:, None].transpose(-2, -1) + const + q_r @ k_r.transpose(-2, -1)
    return scores / math.sqrt(d_h)


def convert_lm(lm: nn.Module, keep: int, rank: int | None) -> nn.Module:
    """A copy of the char GPT `lm` with every block's attention converted by :func:`partial_rope_latent`."""
    out = copy.deepcopy(lm)
    for block in out.blocks:
        block.attn = partial_rope_latent(block.attn, keep, rank)
    return out


def main(out_dir: str | Path = "notebooks/results") -> dict:
    from .char_lm import char_lm, tatoeba_chars
    from .uptrain_lm import held_out, uptrain

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    text_train, text_held, vocab = tatoeba_chars(out_dir.parent / "data" / "tatoeba" / "eng-fra-5000.txt")
    stored = torch.load(out_dir / "char_lm_rope.pt", weights_only=True)
    held = held_out(text_held)
    result = {"seeds": stored["seeds"], "steps": [0, UPTRAIN_STEPS], "variants": {k: list(v) for k, v in VARIANTS.items()},
              "loss": {name: [] for name in VARIANTS}}
    for seed, state in zip(stored["seeds"], stored["state"]):
        lm = char_lm(len(vocab), seed)
        lm.load_state_dict(state)
        for name, (keep, rank) in VARIANTS.items():
            model = convert_lm(lm, keep, rank)
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
