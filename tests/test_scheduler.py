"""The chunked-prefill scheduler: token budgets, stalls, and the bookkeeping of simulated time."""

import pytest

from attncourse.scheduler import A100_7B, Request, StepCost, random_workload, simulate

FLAT = StepCost(memory_s=0.01, token_s=0.001)  # a step of n tokens: max(10 ms, n ms)


def test_one_request_alone():
    r = simulate([Request(0.0, 100, 3)], token_budget=40, chunked=True, cost=FLAT)
    assert r.step_tokens == [40, 40, 20, 1, 1]  # three prompt chunks, then two decodes
    assert r.ttft == [pytest.approx(0.1)] and r.tbt == [pytest.approx(0.01)] * 2
    assert r.output_tokens == 3 and r.prompt_tokens == 100


def test_a_long_prompt_stalls_running_decodes_without_chunking():
    reqs = [Request(0.0, 10, 50), Request(0.05, 400, 2)]
    whole = simulate(reqs, token_budget=1000, chunked=False, cost=FLAT)
    chunked = simulate(reqs, token_budget=64, chunked=True, cost=FLAT)
    assert max(whole.tbt) == pytest.approx(0.41)  # the whole 400-token prefill, then its own decode step
    assert max(chunked.tbt) == pytest.approx(0.064)  # at most one budget-sized step between two tokens
    assert all(n <= 64 for n in chunked.step_tokens)
    assert whole.output_tokens == chunked.output_tokens == 52


def test_chunking_bounds_the_gap_on_random_workloads():
    for seed in range(3):
        reqs = random_workload(seed, 16, rate=10.0)
        whole = simulate(reqs, token_budget=4096, chunked=False)
        chunked = simulate(reqs, token_budget=256, chunked=True)
        assert max(chunked.tbt) <= A100_7B(256) + 1e-12 < max(whole.tbt)
        assert chunked.prompt_tokens == whole.prompt_tokens == sum(r.prompt_len for r in reqs)


def test_bad_input():
    with pytest.raises(TypeError, match="requests"):
        simulate([], token_budget=8, chunked=True)
    with pytest.raises(ValueError, match="token_budget"):
        simulate([Request(0.0, 4, 1)], token_budget=0, chunked=True)
    with pytest.raises(TypeError, match="chunked"):
        simulate([Request(0.0, 4, 1)], token_budget=8, chunked=1)
    with pytest.raises(ValueError, match="seed"):
        random_workload(-1)


def test_kv_reads_lengthen_decode_steps_by_the_cache_they_read():
    cost = StepCost(memory_s=1.0, token_s=0.01, overhead_s=0.5, kv_token_s=0.001)
    res = simulate([Request(0.0, 100, 4)], token_budget=512, chunked=True, cost=cost)
    assert res.ttft == [pytest.approx(1.0 + 100 * 0.001 + 0.5)]  # the prefill reads its 100 tokens
    # decode step g reads the prompt and the g tokens generated so far
    assert res.tbt == [pytest.approx(1.0 + (100 + g) * 0.001 + 0.5) for g in (1, 2, 3)]
    base = simulate([Request(0.0, 100, 4)], token_budget=512, chunked=True, cost=StepCost(1.0, 0.01, 0.5))
    assert base.tbt == [pytest.approx(1.5)] * 3


def test_preemption_by_recompute_when_the_pool_runs_out():
    reqs = [Request(0.0, 40, 30), Request(0.0, 40, 30), Request(0.0, 40, 30)]
    free = simulate(reqs, token_budget=256, chunked=True, cost=FLAT)
    assert free.preemptions == 0 and free.prompt_tokens == 120
    tight = simulate(reqs, token_budget=256, chunked=True, cost=FLAT, kv_pool=150)
    assert tight.preemptions > 0 and tight.recomputed_tokens > 0
    assert tight.output_tokens == 90  # every request still finishes
    assert tight.prompt_tokens > 120  # preempted requests prefill their prompt and their output again
    assert max(tight.tbt) > max(free.tbt)  # a preempted request waits
    for pool in (70, 100, 150, 210):
        r = simulate(reqs, token_budget=256, chunked=True, cost=FLAT, kv_pool=pool)
        assert r.output_tokens == 90
    assert simulate(reqs, token_budget=256, chunked=True, cost=FLAT, kv_pool=210).preemptions == 0
    with pytest.raises(ValueError, match="kv_pool"):
        simulate(reqs, token_budget=256, chunked=True, cost=FLAT, kv_pool=69)
