r"""Test bed 3 of chapter 11 with a *trained* model: the recall prompts of :mod:`attncourse.kv_recall` (16 key-value
pairs, a separator, a question of 3 keys at the end) answered by a 2-layer attention-only transformer that learned
the task, instead of the hand-set circuit. Its attention is learned, so how sharply the question's queries point at
the values the answers need, and so what SnapKV's vote and H2O's accumulated attention keep, is the model's own.

:func:`train_recall_model` trains one seed (multi-query associative recall, the loss on the answers only, as in
Zoology) until it answers 99 % of held-out prompts; :func:`recall_table` scores every cache policy of chapter 11's
test bed 3 on it, teacher-forced, plus the decoded run of two of them.
``python -m attncourse.kv_recall_trained`` trains seeds 0-2 (17-34 s of CPU each) and stores the weights
(``notebooks/results/ch11_recall_trained.pt``) and the table (``ch11_recall_trained.json``); the lesson loads both
and re-measures one seed live.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import _validate
from .heads import AttnOnlyConfig, AttnOnlyTransformer
from .kv_recall import N_KEYS, answer_accuracy, prefill_maps, question_batch

__all__ = ["POLICIES", "BUDGETS", "new_model", "train_recall_model", "recall_table", "main"]

POLICIES = {"SnapKV, no pooling": ("snapkv", 1), "SnapKV, avg over 5": ("snapkv", 5), "H2O": ("h2o", 5),
            "recent (window)": ("recent", 5), "random": ("random", 5)}  # name -> (kv_recall policy, kernel)
BUDGETS = (6, 12, 18)  # prompt keys kept per head, of 36
DECODED = ("SnapKV, avg over 5", "H2O")  # also run with the model's own answers fed back, at the smallest budget
MAX_STEPS, BATCH, LR, TARGET = 6000, 64, 3e-3, 0.99
RESULTS = Path(__file__).resolve().parent.parent / "notebooks" / "results"


def new_model() -> AttnOnlyTransformer:
    """The architecture: 2 attention-only layers with LayerNorm, d = 64, 2 heads, learned positions (48)."""
    return AttnOnlyTransformer(AttnOnlyConfig(vocab_size=2 * N_KEYS + 1, block_size=48, d_model=64, n_heads=2,
                                              n_layers=2))


def train_recall_model(seed: int, max_steps: int = MAX_STEPS, batch: int = BATCH, lr: float = LR,
                       target: float = TARGET) -> tuple[AttnOnlyTransformer, dict]:
    """Train one model on fresh recall prompts every step (AdamW, `lr` after 100 steps of linear warm-up), the
    cross-entropy on the 3 answer tokens only, until its answer accuracy on 256 validation prompts (generator
    2000 + seed, not the test prompts) reaches `target` (checked every 100 steps) or `max_steps` have run.
    Returns (the model in eval mode, ``{"losses": the loss every 100 steps, "steps": steps run, "val": the last
    validation accuracy}``). Raises TypeError/ValueError for a seed that is not a non-negative int, max_steps or
    batch that is not a positive int, or an lr or target out of range."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise TypeError(f"seed must be a non-negative int, got {seed!r}")
    _validate.positive_int("max_steps", max_steps)
    _validate.positive_int("batch", batch)
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not isinstance(target, (int, float)) or not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    torch.manual_seed(seed)
    model = new_model()
    data = torch.Generator().manual_seed(1000 + seed)
    val_tokens, val_prompt, val_answers = question_batch(torch.Generator().manual_seed(2000 + seed), 256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))
    losses, val, step = [], 0.0, 0
    while step < max_steps:
        tokens, _, answers = question_batch(data, batch)  # (B, 42), answer positions (3,)
        logits = model(tokens[:, :-1])  # (B, 41, V): position t predicts token t + 1
        loss = F.cross_entropy(logits[:, answers - 1].flatten(0, 1), tokens[:, answers].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % 100 == 0:
            losses.append(loss.item())
            model.eval()
            val = answer_accuracy(model, val_tokens, val_prompt, val_answers)["accuracy"]
            model.train()
            if val >= target:
                break
    return model.eval(), {"losses": losses, "steps": step, "val": val}


def recall_table(model: AttnOnlyTransformer, seed: int, n_prompts: int = 256) -> dict:
    """Answer accuracy of every policy at every budget on `n_prompts` held-out prompts (generator 500 + seed, as the
    planted test bed's), teacher-forced; ``"full"``: the whole cache; ``"decoded"``: :data:`DECODED` at the smallest
    budget with the model's own answers fed back; ``"vote_on_values"``: the share of the last layer's question
    attention (its last 3 queries, averaged over heads) that lands on the 3 values the answers need."""
    _validate.positive_int("n_prompts", n_prompts)
    tokens, prompt, answers = question_batch(torch.Generator().manual_seed(500 + seed), n_prompts)
    maps = prefill_maps(model, tokens, prompt)  # one prefill; each policy selects from its maps
    table = {"full": answer_accuracy(model, tokens, prompt, answers, maps=maps)["accuracy"], "policies": {},
             "decoded": {}}
    for name, (policy, kernel) in POLICIES.items():
        table["policies"][name] = [answer_accuracy(model, tokens, prompt, answers, policy, budget, kernel=kernel,
                                                   maps=maps, generator=torch.Generator().manual_seed(seed))["accuracy"]
                                   for budget in BUDGETS]
    for name in DECODED:
        policy, kernel = POLICIES[name]
        table["decoded"][name] = answer_accuracy(model, tokens, prompt, answers, policy, BUDGETS[0], kernel=kernel,
                                                 maps=maps, decoded=True)["accuracy"]
    n_pairs = (prompt - 1 - 3) // 2
    questions = tokens[:, 2 * n_pairs + 1:prompt]  # (B, 3) the question's keys
    need = torch.stack([(tokens[:, 0:2 * n_pairs:2] == q[:, None]).float().argmax(1) * 2 + 1 for q in questions.T],
                       1)  # (B, 3): the value positions the answers read
    vote = maps[-1][:, :, prompt - 3:, :].mean(1)  # (B, 3, P): last layer, question queries, heads averaged
    table["vote_on_values"] = vote.gather(2, need[:, None, :].expand(-1, 3, -1)).sum(-1).mean().item()
    return table


def _run(seed: int) -> tuple[int, dict, dict, float]:
    torch.set_num_threads(1)
    start = time.process_time()
    model, run = train_recall_model(seed)
    cpu = time.process_time() - start
    return seed, model.state_dict(), {**run, "train_cpu_s": round(cpu, 1), **recall_table(model, seed)}, cpu


def main(seeds=(0, 1, 2), processes: int = 3) -> dict:
    """Train and score `seeds` in forked processes; store the weights and the table in notebooks/results/."""
    from ._procs import forked_map

    with forked_map(processes) as run:
        results = list(run(_run, seeds))
    record = {"max_steps": MAX_STEPS, "batch": BATCH, "lr": LR, "target": TARGET, "budgets": list(BUDGETS),
              "n_prompts": 256,
              "seeds": {str(seed): table for seed, _, table, _ in results}}
    torch.save({str(seed): state for seed, state, _, _ in results}, RESULTS / "ch11_recall_trained.pt")
    (RESULTS / "ch11_recall_trained.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    out = main()
    for seed, table in out["seeds"].items():
        print(seed, table["steps"], table["val"], table["train_cpu_s"], table["full"], table["vote_on_values"],
              table["decoded"])
        for name, accs in table["policies"].items():
            print("  ", f"{name:20}", [round(a, 3) for a in accs])
