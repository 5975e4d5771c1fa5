r"""Chunked prefill as a scheduling policy (SARATHI, Agrawal et al. 2023; vLLM and SGLang's chunked prefill).

A serving engine runs one forward pass per *step* over a batch of tokens: one token for each running request
that is decoding, plus prompt tokens of requests being prefilled. The step's duration is set by the tokens it
holds. Decoding is memory-bound (every step reads all the weights, whatever the batch), a prefill is
compute-bound (its cost grows with its tokens). Two policies for a new long prompt:

* **no chunking** (vLLM's original scheduler): a step prefills whole prompts, and the running requests' decodes
  wait for it: each of them sees one long gap between two tokens (a *stall*);
* **chunked prefill** (SARATHI): every step first takes the running decodes, then fills the rest of a fixed
  *token budget* with a chunk of the waiting prompt, so a prompt of P tokens spreads over about
  P / budget steps that each also advance every decode ("piggybacking" decodes on the prefill).

:func:`simulate` runs either policy on a list of :class:`Request` with a :class:`StepCost` model and reports the
time between tokens (TBT) every decoding request sees, time to first token (TTFT) and throughput. The cost
model is a roofline: a step takes ``max(weights read once, tokens x FLOPs per token) + a fixed overhead``; with
``StepCost.kv_token_s`` the memory side also reads every cached token the step's queries attend to.
Everything is deterministic (simulated time), so the numbers do not depend on the machine running it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _validate

__all__ = ["Request", "StepCost", "SimResult", "simulate", "random_workload", "A100_7B", "A100_7B_KV"]


@dataclass(frozen=True)
class Request:
    """A request arriving at `arrival` seconds with a prompt of `prompt_len` tokens that will generate
    `output_len` tokens (the first one at the end of its prefill)."""

    arrival: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class StepCost:
    """Duration of a step of `n` tokens reading `kv` cached tokens:
    ``max(memory_s + kv * kv_token_s, n * token_s) + overhead_s`` seconds (``kv_token_s = 0``: weights only)."""

    memory_s: float  # reading the weights once (the whole cost of a small decode batch)
    token_s: float  # compute per token once the step is compute-bound
    overhead_s: float = 0.0
    kv_token_s: float = 0.0  # reading one cached token's keys and values (every layer) once

    def __call__(self, n_tokens: int, kv_tokens: int = 0) -> float:
        return max(self.memory_s + kv_tokens * self.kv_token_s, n_tokens * self.token_s) + self.overhead_s


# A 7B-parameter model in bfloat16 on an A100 (1.6 TB/s, 312 TFLOP/s dense bf16 at an assumed 50 % utilisation):
# 14 GB of weights read per step, 2 x 7e9 FLOPs per token; attention's own cost is left out (small at these lengths).
A100_7B = StepCost(memory_s=14e9 / 1.6e12, token_s=2 * 7e9 / (0.5 * 312e12), overhead_s=1e-3)
# The same with the KV-cache reads: a LLaMA-2-7B token's keys and values, 2 x 32 layers x 4096 x 2 bytes = 512 KiB.
A100_7B_KV = StepCost(memory_s=14e9 / 1.6e12, token_s=2 * 7e9 / (0.5 * 312e12), overhead_s=1e-3,
                      kv_token_s=2 * 32 * 4096 * 2 / 1.6e12)


@dataclass
class SimResult:
    """What :func:`simulate` measured (all times in seconds)."""

    tbt: list[float] = field(default_factory=list)  # every gap between two consecutive tokens of a request
    ttft: list[float] = field(default_factory=list)  # per request: first token time - arrival
    steps: int = 0
    makespan: float = 0.0  # time when the last request finished
    output_tokens: int = 0
    prompt_tokens: int = 0
    step_tokens: list[int] = field(default_factory=list)
    preemptions: int = 0  # requests evicted from the KV pool (recompute)
    recomputed_tokens: int = 0  # cached tokens those preemptions threw away

    def tbt_quantile(self, q: float) -> float:
        return float(torch.quantile(torch.tensor(self.tbt, dtype=torch.float64), q)) if self.tbt else 0.0

    @property
    def throughput(self) -> float:
        """Tokens processed per second (prompt and generated)."""
        return (self.output_tokens + self.prompt_tokens) / self.makespan


def simulate(requests: list[Request], *, token_budget: int, chunked: bool, cost: StepCost = A100_7B,
             max_running: int = 256, kv_pool: int | None = None) -> SimResult:
    """Serve `requests` step by step with one of the two policies (see the module docstring).

    `token_budget` caps the tokens of a step: with `chunked`, decodes first and prompt chunks fill the rest;
    without, a step prefills whole prompts (at least one, however long, more while they fit in the budget)
    and no decode runs in it. At most `max_running` requests are admitted at once (first come, first served).

    `kv_pool`: None (unbounded) or the tokens the KV cache holds. A request is admitted only when its prompt fits
    beside what is cached; when the next step's new tokens do not fit, the request admitted last is **preempted
    by recompute** (vLLM's default): its cache is freed, it goes back to the front of the queue, and when
    readmitted it prefills its prompt and every token it had generated again, then carries on decoding.
    """
    if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests) or not requests:
        raise TypeError("requests must be a non-empty list of Request")
    _validate.positive_int("token_budget", token_budget)
    _validate.positive_int("max_running", max_running)
    if not isinstance(chunked, bool):
        raise TypeError(f"chunked must be a bool, got {type(chunked).__name__}")
    if kv_pool is not None:
        _validate.positive_int("kv_pool", kv_pool)
        most = max(r.prompt_len + r.output_len for r in requests)
        if most > kv_pool:
            raise ValueError(f"kv_pool={kv_pool} cannot hold one request of {most} tokens (prompt + output)")
    pool = float("inf") if kv_pool is None else kv_pool
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival)  # not arrived or not admitted
    target = [r.prompt_len for r in requests]  # tokens to prefill: the prompt, or after a preemption also the output
    prefilled = [0] * len(requests)  # of target, done
    cached = [0] * len(requests)  # tokens in the KV cache
    generated = [0] * len(requests)
    last_token = [0.0] * len(requests)
    prefilling: list[int] = []  # admitted, prompt not finished (FCFS)
    decoding: list[int] = []
    admitted: list[int] = []  # running requests in admission order (the last one is preempted first)
    result, now = SimResult(), 0.0
    while pending or prefilling or decoding:
        while (pending and requests[pending[0]].arrival <= now and len(prefilling) + len(decoding) < max_running
               and sum(cached) + target[pending[0]] <= pool):
            admitted.append(pending[0])
            prefilling.append(pending.pop(0))
        if not prefilling and not decoding:
            now = max(now, requests[pending[0]].arrival)
            continue
        while True:  # plan the step; preempt while its new tokens do not fit in the pool
            chunks: list[tuple[int, int]] = []  # (request, prompt tokens this step)
            if chunked:
                batch_decodes = list(decoding)
                room = token_budget - len(batch_decodes)
                for i in prefilling:
                    if room <= 0:
                        break
                    n = min(room, target[i] - prefilled[i])
                    chunks.append((i, n))
                    room -= n
            elif prefilling:  # whole prompts, decodes wait
                batch_decodes, room = [], token_budget
                for i in prefilling:
                    n = target[i] - prefilled[i]
                    if chunks and n > room:
                        break
                    chunks.append((i, n))
                    room -= n
            else:
                batch_decodes = list(decoding)
            new = len(batch_decodes) + sum(n for _, n in chunks)
            if sum(cached) + new <= pool or len(admitted) == 1:
                break
            victim = admitted.pop()  # recompute: free its cache, back to the front of the queue
            (decoding if victim in decoding else prefilling).remove(victim)
            result.preemptions += 1
            result.recomputed_tokens += cached[victim]
            cached[victim], prefilled[victim] = 0, 0
            target[victim] = requests[victim].prompt_len + generated[victim]
            pending.insert(0, victim)
        n_tokens = len(batch_decodes) + sum(n for _, n in chunks)
        kv_tokens = sum(requests[i].prompt_len + generated[i] for i in batch_decodes)  # each decode reads its cache
        kv_tokens += sum(prefilled[i] + n for i, n in chunks)  # a chunk reads the prompt so far and itself
        now += cost(n_tokens, kv_tokens)
        result.steps += 1
        result.step_tokens.append(n_tokens)
        for i in batch_decodes:  # one token each
            cached[i] += 1
            result.tbt.append(now - last_token[i])
            last_token[i], generated[i] = now, generated[i] + 1
            if generated[i] == requests[i].output_len:
                decoding.remove(i)
                admitted.remove(i)
                cached[i] = 0
        for i, n in chunks:
            prefilled[i] += n
            cached[i] += n
            result.prompt_tokens += n
            if prefilled[i] == target[i]:  # prefill done: its next token comes out now
                prefilling.remove(i)
                if generated[i] == 0:
                    result.ttft.append(now - requests[i].arrival)
                else:  # a preempted request, recomputed
                    result.tbt.append(now - last_token[i])
                last_token[i], generated[i] = now, generated[i] + 1
                if generated[i] < requests[i].output_len:
                    decoding.append(i)
                else:
                    admitted.remove(i)
                    cached[i] = 0
    result.makespan = now
    result.output_tokens = sum(generated)
    return result


def random_workload(seed: int, n_requests: int = 24, *, rate: float = 4.0, prompt_lens: tuple[int, int] = (64, 4096),
                    output_lens: tuple[int, int] = (64, 256)) -> list[Request]:
    """`n_requests` with Poisson arrivals at `rate` per second and prompt and output lengths drawn uniformly
    (log-uniform for prompts: many short, a few long) from the given ranges, from a generator seeded `seed`."""
    _validate.positive_int("n_requests", n_requests)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n_requests, dtype=torch.float64).exponential_(rate, generator=gen)
    arrivals = torch.cumsum(gaps, 0) - gaps[0]
    lo, hi = (torch.tensor(float(x), dtype=torch.float64).log() for x in prompt_lens)
    prompts = torch.exp(lo + (hi - lo) * torch.rand(n_requests, generator=gen, dtype=torch.float64)).round().long()
    outputs = torch.randint(output_lens[0], output_lens[1] + 1, (n_requests,), generator=gen)
    return [Request(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]
