"""Chapter 12's exercises on sinks: a learned sink logit (gpt-oss), and predicting a sink's share of a row and a
sigmoid row's total."""

from __future__ import annotations

import math

import torch

from attncourse.sink_variants import sink_softmax_attention
from attncourse.variants import sigmoid_attention
from . import Case, exercise


# ----------------------------------------------------------------------------- a learned sink logit (gpt-oss)


def _shortcut_sink(q, k, v, sink_logits, is_causal=False):
    return sink_softmax_attention(q, k, v, sink_logits, is_causal=is_causal)


def _shortcut_online_sink(q, k, v, sink_logits, is_causal=False):
    from attncourse.online_softmax import online_attention
    return online_attention(q, k, v, is_causal=is_causal, sink_logits=sink_logits)[0]


def _inputs_dtype(runs) -> str | None:
    """The output comes back in the inputs' dtype: a float32 answer computed in float64 must be rounded back (the
    course's rule for every attention: compute where it is safe, return what came in)."""
    for run in runs:
        want = run.case.args[0].dtype
        if isinstance(run.got, torch.Tensor) and run.got.dtype != want:
            return (f"on case '{run.case.name}' the output is {str(run.got.dtype)[6:]} for {str(want)[6:]} inputs: "
                    "return it in the inputs' dtype")
    return None


def _breaker_float64_out(q, k, v, sink_logits, is_causal=False):
    """The right values, computed in float64 and returned in float64 whatever came in."""
    s = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5  # (..., Tq, Tk)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(), float("-inf"))
    sink = sink_logits.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)  # (B, H, Tq, 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink)
    e = torch.exp(s - m)
    return (e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))) @ v.double()


@exercise("12-sink-logit", "sink_attn", points=2, category="implement",
          forbid=("attncourse.sink_variants.sink_softmax_attention", "attncourse.sink_variants.SinkLogitAttention",
                  "attncourse.sdpa.scaled_dot_product_attention", "attncourse.scaled_dot_product_attention",
                  "torch.nn.functional.scaled_dot_product_attention",
                  "attncourse.online_softmax.online_attention", "attncourse.online_attention",
                  "attncourse.online_softmax.fold_sink_logit", "attncourse.fold_sink_logit"),
          allow=(), ops=("attention", "softmax", "logsumexp"), prop=_inputs_dtype,
          prop_doc="the output in the inputs' dtype; "
                   "a closed formula: equal outputs in float64 and float32 (including rows whose scores sit near 300 and "
                   "near 3000, where exponentials without a shift overflow even in float64), causal or not, Tq != Tk, once softmax, logsumexp, "
                   "every fused attention and the package's sink attention are refused",
          shortcuts=(_shortcut_sink, _shortcut_online_sink), breakers=(_breaker_float64_out,),
          hint="the row's normaliser is the sum of the exponentiated scores plus e^{s_h}; shift every exponent (the "
               "sink's too) by one reference before exponentiating, and block future keys with a score of minus "
               "infinity when asked")
def _sink_logit():
    """Softmax attention with one learned sink logit per head, from its definition."""
    gen = torch.Generator().manual_seed(128)
    cases = []
    for (b, h, tq, tk, d), causal, shift, sink_scale, dtype in (
            ((2, 3, 5, 5, 8), False, 0.0, 1.0, torch.float64),
            ((1, 2, 4, 9, 4), False, 0.0, 3.0, torch.float64),
            ((2, 2, 6, 6, 8), True, 0.0, 1.0, torch.float64),
            ((1, 4, 3, 7, 8), False, 300.0, 1.0, torch.float32),  # scores near 300: exp overflows without a shift
            ((1, 2, 5, 5, 4), True, 0.0, 1.0, torch.float32),
            ((1, 4, 3, 6, 8), True, 3000.0, 1.0, torch.float32)):  # past float64 too: e^3000 is inf in any dtype
        q, k = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for t in (tq, tk))
        v = torch.randn(b, h, tk, d, generator=gen, dtype=torch.float64)
        sink = torch.randn(h, generator=gen, dtype=torch.float64) * sink_scale
        if shift:  # q k / sqrt(d) near `shift` (an offset shared by all pairs), the sink logits far above or below it
            offset = (shift / d ** 0.5) ** 0.5
            q, k = 0.1 * q + offset, 0.1 * k + offset
            sink = torch.tensor([shift + 150.0, shift - 150.0, shift, shift + 90.0][:h], dtype=torch.float64)
        q, k, v, sink = (x.to(dtype) for x in (q, k, v, sink))
        expected = _shortcut_sink(q.double(), k.double(), v.double(), sink.double(), is_causal=causal).to(dtype)
        tol = dict(rtol=1e-7, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
        if shift > 1000:  # float32 scores near 3000 carry rounding of about 1e-3: the weights agree to ~1e-2
            tol = dict(rtol=2e-2, atol=2e-3)
        elif shift:  # float32 scores near 300 carry rounding of about 3e-5: a right float32 answer is off by up to
            tol = dict(rtol=1e-3, atol=2e-4)  # 3.9e-5 over 300 draws (1e-4 and 1e-5 failed the solution 2 runs in 8)
        cases.append(Case(f"q {tuple(q.shape)}, k {tuple(k.shape)}, {str(dtype)[6:]}, is_causal={causal}"
                          + (f", scores near {shift:g}" if shift else ""), (q, k, v, sink), {"is_causal": causal},
                          expected=expected, **tol))
    return cases


# ----------------------------------------------------------------------------- predict: a sink's share, a sigmoid row


def _sink_row(n: int, x: float, s: float) -> tuple[float, float]:
    """The package's answer for one query over n keys that all score x: (sink share of a gpt-oss row with sink
    logit s, total weight of a sigmoid row with its bias -log n). Built from q = [x], keys = ones, D = 1."""
    from attncourse.sink_variants import sink_softmax_attention
    q = torch.full((1, 1, 1, 1), float(x), dtype=torch.float64)  # (B, H, Tq, D): q . k / sqrt(1) = x for every key
    k = torch.ones(1, 1, n, 1, dtype=torch.float64)  # (B, H, n, D)
    v = torch.zeros(1, 1, n, 1, dtype=torch.float64)
    _, w = sink_softmax_attention(q, k, v, torch.tensor([float(s)], dtype=torch.float64), return_weights=True)
    _, ws = sigmoid_attention(q, k, v, return_weights=True)
    return 1 - w.sum().item(), ws.sum().item()


def sink_row_closed_form(n: int, x: float, s: float) -> tuple[float, float]:
    """The same two numbers from their closed forms, for contexts far too long to build a row of (n up to 10^15):
    e^s / (e^s + n e^x) and n sigma(x - log n) = n / (1 + n e^-x). tests/test_ch12_checks.py checks them against
    :func:`_sink_row` on rows the package can build."""
    return 1 / (1 + n * math.exp(x - s)), n / (1 + n * math.exp(-x))


@exercise("12-predict", "predicted", points=1, category="predict",
          parts=("the sink's share of the row at n keys", "the sink logit that keeps that share at m keys",
                 "a sigmoid row's total weight at n keys"),
          forbid=("attncourse.sink_softmax_attention", "attncourse.sink_variants.sink_softmax_attention",
                  "attncourse.SinkLogitAttention", "attncourse.sink_variants.SinkLogitAttention",
                  "attncourse.sigmoid_attention", "attncourse.variants.sigmoid_attention",
                  "attncourse.SigmoidAttention", "attncourse.variants.SigmoidAttention"),
          allow=(), ops=("torch", "numpy"),
          prop_doc="the prediction is a function of (n, m, x, s) checked on configurations drawn by the checker, so "
                   "no printed number can stand in for it; the package's sink and sigmoid attentions, tensors and "
                   "NumPy are refused, and half the drawn contexts hold 10^9 to 10^15 keys, so a row built and "
                   "summed in plain Python (or a bisection over such rows) cannot finish: the three closed forms "
                   "are the skill",
          hint="write one row of each weighting with every real score equal to x: the sink is one more term in "
               "the denominator, and its share is its term over the whole denominator; for the second part ask what "
               "the sink logit must do to keep that ratio when the number of real terms changes; a sigmoid row has "
               "no denominator shared by its keys: add up n equal weights, then write the sum without a loop")
def _predict():
    """Predict, for one query over n keys that all score x: the share a gpt-oss sink logit s takes, the sink logit
    that keeps that share over m keys, and the total weight of a sigmoid row (bias -log n)."""
    gen = torch.Generator().manual_seed(126)  # configurations drawn here (a salted grader draws others)
    cases = []
    for i in range(6):
        long = i % 2 == 1  # every other case: contexts no row can be built for (10^9 to 10^15 keys)
        lo, hi = (9.0, 15.0) if long else (math.log10(2), math.log10(50000))
        n, m = (int(10 ** float(torch.empty(1).uniform_(lo, hi, generator=gen))) for _ in range(2))
        x = round(float(torch.empty(1).uniform_(-3, 3, generator=gen)), 3)
        s = round(float(torch.empty(1).uniform_(-2, 8, generator=gen)), 3)
        share, total = sink_row_closed_form(n, x, s) if long else _sink_row(n, x, s)
        s_m = s + math.log(m / n)  # checked against the package's row in tests/test_ch12_checks.py
        cases.append(Case(f"n={n} keys, m={m}, every score x={x}, sink logit s={s}", (n, m, x, s),
                          expected=(share, s_m, total), rtol=1e-6, atol=1e-12))
    return cases
