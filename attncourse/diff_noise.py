"""Differential attention where its paper says it matters: retrieval with many distractors (lesson 12, section 4c).

Ye et al. (2024, "Differential Transformer") motivate the two subtracted maps with *attention noise*: a softmax head
that should read one key also spreads weight over the irrelevant ones, more of it the more there are (their Fig. 1
measures the attention score on the answer span against the noise context in a retrieval task; their multi-needle
retrieval experiment tests accuracy). The CPU-sized version here is multi-query associative recall
(:func:`attncourse.recall.mqar_batch`): N (key, value) pairs, one per position, then the N keys again in a random
order, each query to be answered with its value. Every pair but one is a distractor for a given query, so N sets the
noise. One model is trained on a mix of N (a new N every step) and tested at every N of :data:`TEST_PAIRS`.

The two models are :class:`RetrievalModel` (2 attention layers, d = 64, no MLPs, no positions), head-matched as
section 4c's baseline: softmax with 4 heads of 16 against differential attention with 2 heads of two 16-wide maps
(values 32 wide), as Ye et al. give a differential layer half the heads. ``python -m attncourse.diff_noise`` trains
both over three seeds and stores what :func:`read_run` measures in ``notebooks/results/ch12_diff_noise.json``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from ._procs import forked_map as _pool

VOCAB = 256  # 256 key ids and 256 value ids
GROUPS = 16  # key id = 16 * group + member: a key is two features, and distractors share one of them with the needle
TRAIN_PAIRS = (4, 8, 16, 32)  # N drawn from these every step
TEST_PAIRS = (8, 32, 64, 128, 256)  # up to 8 times the distractors of training
RECIPE = dict(steps=400, lr=3e-3, warmup=50, batch_size=32)
MODELS = {"softmax": 4, "differential": 2}  # heads: softmax 4 of 16, differential 2 of two 16-wide maps
SEEDS = (0, 1, 2)


class RetrievalModel(nn.Module):
    """Key and value embeddings summed per position (a query position has the "no value" id), ``n_layers`` pre-norm
    residual attention layers, a read-out over the values: ``(keys, values) (B, T) -> logits (B, T, VOCAB)``.
    No position encoding: a pair's place in the list carries nothing. ``forward(..., return_weights=True)`` also
    returns each layer's map (B, H, T, T) (differential: the difference of the two maps)."""

    def __init__(self, attention: str, d_model: int = 64, n_layers: int = 2):
        super().__init__()
        from .mha import MultiHeadAttention
        from .variants import DifferentialAttention
        if attention not in MODELS:
            raise ValueError(f"attention must be one of {tuple(MODELS)}, got {attention!r}")
        self.group_emb = nn.Embedding(GROUPS, d_model)  # a key is seen as its two parts, group and member
        self.member_emb = nn.Embedding(VOCAB // GROUPS, d_model)
        self.value_emb = nn.Embedding(VOCAB + 1, d_model)  # id VOCAB: no value (a query)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.attns = nn.ModuleList(
            MultiHeadAttention(d_model, MODELS[attention]) if attention == "softmax"
            else DifferentialAttention(d_model, MODELS[attention], layer=i + 1) for i in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, keys: torch.Tensor, values: torch.Tensor, *, return_weights: bool = False):
        x = (self.group_emb(keys // (VOCAB // GROUPS)) + self.member_emb(keys % (VOCAB // GROUPS))
             + self.value_emb(values))  # (B, T, d)
        maps = []
        for norm, attn in zip(self.norms, self.attns):
            a, w = attn(norm(x), is_causal=True, return_weights=True)  # (B, T, d), (B, H, T, T)
            x = x + a
            maps.append(w)
        logits = self.head(self.norm(x))  # (B, T, VOCAB)
        return (logits, maps) if return_weights else logits


def new_model(name: str, seed: int) -> RetrievalModel:
    """The untrained model `name` (a key of :data:`MODELS`) of seed `seed` (the global seed is not moved)."""
    if name not in MODELS:
        raise ValueError(f"name must be one of {tuple(MODELS)}, got {name!r}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return RetrievalModel(name)


def batch(gen: torch.Generator, batch_size: int, n_pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
    """MQAR (:func:`attncourse.recall.mqar_batch`: N pairs, then the N keys as queries in a random order):
    (keys (B, 2N), values (B, 2N), targets (B, N), needle (B, N): the position of the pair each query asks for)."""
    from .recall import mqar_batch
    _validate.positive_int("n_pairs", n_pairs)
    if n_pairs > VOCAB:
        raise ValueError(f"n_pairs must be at most {VOCAB} (keys are distinct), got {n_pairs}")
    keys, values, targets = mqar_batch(gen, batch_size, n_pairs, VOCAB, VOCAB)
    needle = (keys[:, n_pairs:, None] == keys[:, None, :n_pairs]).float().argmax(-1)  # (B, N)
    return keys, values, targets, needle


def query_loss(model: nn.Module, keys: torch.Tensor, values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the answers: the logits at each query position against its value."""
    n = targets.shape[1]
    logits = model(keys, values)[:, n:]  # (B, N, VOCAB)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train_run(name: str, seed: int, *, steps: int = RECIPE["steps"], lr: float = RECIPE["lr"],
              warmup: int = RECIPE["warmup"], batch_size: int = RECIPE["batch_size"]) -> tuple[nn.Module, list[float]]:
    """Train model `name` of `seed` with AdamW (linear warm-up, then constant); returns (model, training losses).
    Each step draws N from :data:`TRAIN_PAIRS`; the data depend on the seed only, so both models see the same."""
    for key, x in (("steps", steps), ("warmup", warmup), ("batch_size", batch_size)):
        _validate.positive_int(key, x)
    if not (isinstance(lr, float) and lr > 0):
        raise ValueError(f"lr must be a positive float, got {lr!r}")
    model = new_model(name, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(500 + seed)
    losses = []
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        n = TRAIN_PAIRS[int(torch.randint(len(TRAIN_PAIRS), (1,), generator=gen))]
        keys, values, targets, _ = batch(gen, batch_size, n)
        loss = query_loss(model, keys, values, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return model.eval(), losses


@torch.no_grad()
def needle_and_noise(weights: torch.Tensor, needle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head, at the query positions: the weight on the needle (the asked-for pair's position), the absolute
    weight on the other N - 1 pairs (the distractors) and their signed sum, averaged over rows and queries.

    weights (B, H, 2N, 2N), a layer's map (a differential map may be negative); needle (B, N) -> three (H,) tensors.
    """
    _validate.tensor("weights", weights, min_rank=4, floating=True)
    _validate.tensor("needle", needle, min_rank=2)
    b, h, t, _ = weights.shape
    n = t // 2
    if weights.dim() != 4 or t != 2 * n or weights.shape[-1] != t or needle.shape != (b, n):
        raise ValueError(f"weights must be (B, H, 2N, 2N) and needle (B, N), got {tuple(weights.shape)} and "
                         f"{tuple(needle.shape)}")
    rows = weights[:, :, n:, :n]  # (B, H, N queries, N pairs)
    hit = F.one_hot(needle, n).bool()[:, None]  # (B, 1, N, N): the asked-for pair
    on_needle = (rows * hit).sum(-1)  # (B, H, N)
    noise = (rows.abs() * ~hit).sum(-1)  # (B, H, N)
    net = (rows * ~hit).sum(-1)  # (B, H, N): negative weights cancel positive ones here
    return on_needle.mean((0, 2)), noise.mean((0, 2)), net.mean((0, 2))


@torch.no_grad()
def read_run(model: nn.Module, seed: int, *, queries: int = 4096) -> dict:
    """Held-out accuracy and loss at every N of :data:`TEST_PAIRS` (about `queries` queries each), and the retrieval head (the layer and head with
    the most weight on the needle): its needle weight and distractor weight per N."""
    out: dict = {"accuracy": [], "loss": [], "needle": [], "noise": [], "net_noise": [], "head": []}
    for n in TEST_PAIRS:
        rows = max(1, queries // n)  # about `queries` queries at every N
        keys, values, targets, needle = batch(torch.Generator().manual_seed(9000 + 1000 * seed + n), rows, n)
        logits, maps = model(keys, values, return_weights=True)
        answers = logits[:, n:]  # (B, N, VOCAB)
        out["accuracy"].append((answers.argmax(-1) == targets).float().mean().item())
        out["loss"].append(F.cross_entropy(answers.reshape(-1, VOCAB), targets.reshape(-1)).item())
        per_layer = [needle_and_noise(w.float(), needle) for w in maps]  # per layer: three (H,)
        layer, head = max(((i, j) for i, (nd, _, _) in enumerate(per_layer) for j in range(len(nd))),
                          key=lambda ij: per_layer[ij[0]][0][ij[1]].item())
        out["needle"].append(per_layer[layer][0][head].item())
        out["noise"].append(per_layer[layer][1][head].item())
        out["net_noise"].append(per_layer[layer][2][head].item())
        out["head"].append([layer + 1, head])
    return out


def _job(job: tuple) -> tuple:
    name, seed = job
    torch.set_num_threads(1)
    model, losses = train_run(name, seed)
    return name, seed, read_run(model, seed), losses[::10], model.state_dict() if seed == 0 else None


def run_all(path: str = "notebooks/results/ch12_diff_noise.json", processes: int = 2) -> dict:
    """Train both models over :data:`SEEDS` (6 runs) and store what :func:`read_run` reads off each, with every
    10th training loss; the file is rewritten after every run, and seed 0's weights go next to it."""
    import json
    import os
    from pathlib import Path

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    store: dict = {"made_by": "python -m attncourse.diff_noise", "recipe": RECIPE, "train_pairs": list(TRAIN_PAIRS),
                   "test_pairs": list(TEST_PAIRS), "models": MODELS, "runs": {}}
    with _pool(processes) as pool:
        states = {}
        for name, seed, read, losses, state in pool(_job, [(m, s) for s in SEEDS for m in MODELS]):
            store["runs"].setdefault(name, {})[str(seed)] = read | {"train_loss": losses}
            Path(path).write_text(json.dumps(store, indent=1))
            if state is not None:
                states[name] = state
                torch.save(states, Path(path).with_name("ch12_diff_noise_seed0.pt"))
    return store


if __name__ == "__main__":
    run_all()
