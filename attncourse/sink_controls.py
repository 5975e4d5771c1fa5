r"""Two controls for lesson 12's attention-only model (section 1's data, section 3's recipe).

**Where the repeat sits.** :func:`~attncourse.heads.repeated_segment_tokens` always puts the second copy at the
*end* of a row (L_b <= T/2), so in training a query before position T/2 never has anything to copy and a query in
the last four positions always has. :func:`position_probe` puts a 6-token segment and its repeat in positions
0..11 (then 12 random tokens) or in positions 12..23 (after 12 random tokens) and reads the loss on the repeat and
the weight on key 0 at the same positions with and without a repeat to read. :func:`anywhere_tokens` is data that
loosens the confound: the second copy starts anywhere from its length on, the first copy anywhere before it, and a
fifth of the rows repeat nothing.

**Two more answers to sinks, trained.** ``"softpick"`` (Zuhri et al. 2025, :func:`~attncourse.sink_fixes.softpick`) and
``"softmax_1"`` (Miller 2023: gpt-oss's sink logit frozen at 0) in section 3's harness, 3 seeds.

``python -m attncourse.sink_controls [NAME ...]`` trains the 21 runs of ``SETTINGS`` (or those named; about 7
minutes of CPU in two processes) and stores what :func:`read` measures in ``notebooks/results/ch12_controls.json``,
and seed 0's weights of each setting in ``ch12_controls_seed0.pt`` and ``ch12_controls_anywhere_seed0.pt``
(:func:`load_states` reads both).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from ._procs import forked_map
from . import variant_claims as vc

__all__ = ["anywhere_tokens", "load_states", "position_probe", "probe_batches", "read", "SETTINGS", "run_all"]

RESULTS = Path(__file__).resolve().parents[1] / "notebooks" / "results"
STORED = RESULTS / "ch12_controls.json"
STORED_STATES = RESULTS / "ch12_controls_seed0.pt"  # seed 0's weights: softpick and softmax_1; the "anywhere/*"
STORED_STATES_ANYWHERE = RESULTS / "ch12_controls_anywhere_seed0.pt"  # settings here (two files, each under 1 MB)
SEG = 6  # the probe's segment: repeated in positions SEG..2 SEG - 1 (early) or T - SEG..T - 1 (late)
# name -> (attention, data): "end" is the lesson's data, "anywhere" is anywhere_tokens
SETTINGS = {"softpick": ("softpick", "end"), "softmax_1": ("softmax_1", "end"),
            "anywhere/softmax": ("softmax", "anywhere"), "anywhere/sink_logit": ("sink_logit", "anywhere"),
            "anywhere/gated": ("gated", "anywhere"), "anywhere/sigmoid": ("sigmoid", "anywhere"),
            "anywhere/differential": ("differential", "anywhere")}


def anywhere_tokens(batch_size: int, seq_len: int, vocab_size: int, *, min_len: int = 4, p_none: float = 0.2,
                    generator: torch.Generator | None = None, return_copies: bool = False
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, seq_len) random tokens in which a segment of L_b ~ U{min_len .. seq_len // 2} tokens is repeated: the
    second copy starts at r ~ U{L_b .. T - L_b}, the first at s ~ U{0 .. r - L_b}; a row has no repeat with
    probability `p_none`. Drawing the second copy first spreads it over the row (drawing s first would crowd it
    at the end): every position from min_len on can hold a second copy, a first copy or neither.
    With `return_copies`, also the (B, seq_len) bool masks of the first and of the second copies' positions."""
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("vocab_size", vocab_size),
                    ("min_len", min_len)):
        _validate.positive_int(name, v)
    if not min_len <= seq_len // 2:
        raise ValueError(f"need min_len <= seq_len // 2, got min_len={min_len}, seq_len={seq_len}")
    if not (isinstance(p_none, float) and 0.0 <= p_none <= 1.0):
        raise ValueError(f"p_none must be a float in [0, 1], got {p_none!r}")
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)  # (B, T)
    u = torch.rand(batch_size, 3, generator=generator)  # (B, 3): length, second start, first start
    lens = min_len + (u[:, 0] * (seq_len // 2 - min_len + 1)).long()  # (B,)
    again = lens + (u[:, 1] * (seq_len - 2 * lens + 1)).long()  # (B,) second copy's start, in L .. T - L
    start = (u[:, 2] * (again - lens + 1)).long()  # (B,) first copy's start, in 0 .. r - L
    keep = torch.rand(batch_size, generator=generator) >= p_none  # (B,) rows with a repeat
    pos = torch.arange(seq_len)  # (T,)
    second = (pos >= again[:, None]) & (pos < (again + lens)[:, None]) & keep[:, None]  # (B, T)
    src = (pos - again[:, None] + start[:, None]).clamp(0, seq_len - 1)  # (B, T): where the second copy reads
    tokens = torch.where(second, tokens.gather(1, src), tokens)  # (B, T)
    first = (pos >= start[:, None]) & (pos < (start + lens)[:, None]) & keep[:, None]  # (B, T)
    return (tokens, first, second) if return_copies else tokens


def probe_batches(batch_size: int = 256, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(early, late), each (B, T = 24): a SEG-token segment repeated at positions SEG..2 SEG - 1 then random tokens;
    random tokens then the same segment repeated in the last 2 SEG positions. Positions 0..2 SEG - 1 of `late` and
    2 SEG..T - 1 of `early` are the no-repeat controls at the same positions."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.randint(0, vc.V, (batch_size, SEG), generator=g)  # (B, SEG)
    early = torch.cat([seg, seg, torch.randint(0, vc.V, (batch_size, vc.T - 2 * SEG), generator=g)], 1)
    late = torch.cat([torch.randint(0, vc.V, (batch_size, vc.T - 2 * SEG), generator=g), seg, seg], 1)
    return early, late


@torch.no_grad()
def position_probe(model: nn.Module) -> dict[str, Any]:
    """Loss on the predictable tokens of an early and of a late repeat (queries SEG..2 SEG - 2 and T - SEG..T - 2,
    chance ln V); layer 2's largest per-head weight on key 0 over the queries of the early repeat's second copy
    (SEG..2 SEG - 1), with the repeat there (``key0_early_repeat``) and at the same positions without it
    (``key0_early_none``), and the same over the late repeat's (``key0_late_*``); ``nothing_*``: the largest per-head
    share of a row given to "nothing", 1 - row sum (0 for softmax; a sink logit's share); a gated layer 2 adds
    ``gate_*``, each head's mean gate (H values)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    early, late = probe_batches()
    (le, me), (ll, ml) = model(early, return_weights=True), model(late, return_weights=True)
    gate = getattr(model.attns[1], "last_gate", None)  # (B, H, T, D | 1) of the last call: the late batch
    if gate is not None:
        gate_late = gate.mean(-1)  # (B, H, T)
        model(early)
        gate_early = model.attns[1].last_gate.mean(-1)  # (B, H, T)
    e, t = slice(SEG, 2 * SEG - 1), slice(vc.T - SEG, vc.T - 1)
    loss = lambda logits, x, q: F.cross_entropy(  # noqa: E731
        logits[:, q].transpose(1, 2), x[:, q.start + 1:q.stop + 1]).item()
    out = dict(early_loss=loss(le, early, e), late_loss=loss(ll, late, t))
    for where, q, with_, without in (("early", slice(SEG, 2 * SEG), me, ml), ("late", slice(vc.T - SEG, vc.T), ml, me)):
        out[f"key0_{where}_repeat"] = with_[1][:, :, q, 0].mean((0, 2)).max().item()
        out[f"key0_{where}_none"] = without[1][:, :, q, 0].mean((0, 2)).max().item()
        out[f"nothing_{where}_repeat"] = (1 - with_[1][:, :, q].sum(-1)).mean((0, 2)).max().item()
        out[f"nothing_{where}_none"] = (1 - without[1][:, :, q].sum(-1)).mean((0, 2)).max().item()
        if gate is not None:
            g_with, g_without = (gate_early, gate_late) if where == "early" else (gate_late, gate_early)
            out[f"gate_{where}_repeat"] = g_with[:, :, q].mean((0, 2)).tolist()
            out[f"gate_{where}_none"] = g_without[:, :, q].mean((0, 2)).tolist()
    return out


def read(model: nn.Module) -> dict[str, Any]:
    """:func:`~attncourse.variant_claims.read_run` (the lesson's test sequences) and :func:`position_probe`."""
    return {**vc.read_run(model), **position_probe(model)}


def _batches(data: str):
    if data == "end":
        return None
    return lambda batch_size, generator: anywhere_tokens(batch_size, vc.T, vc.V, generator=generator)


def _job(job: tuple) -> tuple:
    torch.set_num_threads(1)
    name, seed = job
    attention, data = SETTINGS[name]
    model, hist = vc.train_induction(attention, seed, **vc.RECIPE, every=50, make_batch=_batches(data))
    out = dict(read(model), induction=hist["induction"][-1], repeat_curve=hist["repeat"])
    state = {k: v.clone() for k, v in model.state_dict().items()} if seed == 0 else None
    return name, seed, out, state


def load_model(name: str, state: dict) -> nn.Module:
    """A model of setting `name` with the given weights (in eval mode)."""
    if name not in SETTINGS:
        raise ValueError(f"name must be one of {tuple(SETTINGS)}, got {name!r}")
    model = vc.new_model(SETTINGS[name][0], 0)
    model.load_state_dict(state)
    return model.eval()


def _states_path(path: Path, name: str) -> Path:
    return path.with_name(path.stem + ("_anywhere" if name.startswith("anywhere/") else "") + "_seed0.pt")


def load_states(path: str | Path = STORED) -> dict[str, dict]:
    """Seed 0's weights of every stored setting of `path`'s runs: setting name -> state dict."""
    path = Path(path)
    states: dict[str, dict] = {}
    for p in sorted({_states_path(path, name) for name in SETTINGS}):
        states |= torch.load(p) if p.exists() else {}
    return states


def run_all(path: str | Path = STORED, processes: int = 2, names: tuple[str, ...] = tuple(SETTINGS)) -> dict:
    """Train every setting of `names` x seeds 0-2 with section 3's recipe; store :func:`read` per name and seed in
    `path` (the runs of other settings already there are kept), seed 0's weights next to it."""
    import json

    vc._check_run_args(path, processes)
    if not set(names) <= set(SETTINGS):
        raise ValueError(f"names must be among {tuple(SETTINGS)}, got {names!r}")
    path = Path(path)
    store: dict[str, Any] = json.loads(path.read_text()) if path.exists() else \
        {"made_by": "python -m attncourse.sink_controls", "recipe": vc.RECIPE, "runs": {}}
    files = {_states_path(path, name) for name in SETTINGS}
    states: dict[Path, dict] = {p: torch.load(p) if p.exists() else {} for p in files}
    with forked_map(processes) as pool:
        for name, seed, out, state in pool(_job, [(n, s) for n in names for s in vc.SEEDS]):
            store["runs"].setdefault(name, {})[str(seed)] = out
            if state is not None:
                where = _states_path(path, name)
                states[where][name] = state
                torch.save(states[where], where)
            path.write_text(json.dumps(store, indent=1))
    return store


if __name__ == "__main__":
    import sys
    run_all(names=tuple(sys.argv[1:]) or tuple(SETTINGS))  # python -m attncourse.sink_controls [NAME ...]
