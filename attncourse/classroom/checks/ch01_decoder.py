"""Chapter 01's exercise 7 (write Bahdanau et al.'s attention decoder, teacher-forced), solutions/01_additive_attention.ipynb.

The answer gets the decoder's weights in one dict, named as in the paper (appendix A.2.2) with the GRU in PyTorch's
``GRUCell`` layout; expected values come from the package's ``BahdanauSeq2Seq`` holding those very tensors, its
``step`` run once per output step. The answer may not use the package.

The case format's extension for a model's weights: a case's arguments hold a dict of tensors (``params``); the
backward cases ask for the gradients of the top-level floating inputs (the first state and the annotations), which
every weight lies on the path of, so a result computed outside PyTorch, or a state cut off from autograd between
steps, fails there.
"""

from __future__ import annotations

import torch

from attncourse.bahdanau import BahdanauSeq2Seq
from attncourse.seq2seq import Seq2SeqConfig
from . import Case, exercise, graphs

# the dict's keys: the module's tensor each names (submodule, attribute); v_a is stored as a (1, A) row
PLACES = {"E": ("embed", "weight"), "W_a": ("attention.query_proj", "weight"),
          "U_a": ("attention.key_proj", "weight"), "v_a": ("attention.v", "weight"),
          "W_ih": ("decoder", "weight_ih"), "W_hh": ("decoder", "weight_hh"),
          "b_ih": ("decoder", "bias_ih"), "b_hh": ("decoder", "bias_hh"),
          "U_o": ("out_state", "weight"), "b_o": ("out_state", "bias"), "V_o": ("out_token", "weight"),
          "C_o": ("out_context", "weight"), "W_out": ("out", "weight"), "b_out": ("out", "bias")}


def held_decoder(params: dict) -> BahdanauSeq2Seq:
    """A BahdanauSeq2Seq (float64) holding the tensors of `params` themselves (not copies), so gradients reach them."""
    vocab, embed = params["E"].shape
    attention, decoder = params["W_a"].shape
    config = Seq2SeqConfig(num_digits=vocab - 2, embed_size=embed, encoder_size=params["U_a"].shape[1] // 2,
                           decoder_size=decoder, attention_size=attention, maxout_size=params["W_out"].shape[1])
    with torch.random.fork_rng(devices=[]):  # building a module draws from the global generator: keep the learner's
        model = BahdanauSeq2Seq(config).double()
    for key, (where, name) in PLACES.items():
        layer = model.get_submodule(where)
        delattr(layer, name)
        setattr(layer, name, params[key][None] if key == "v_a" else params[key])
    return model


def reference_logits(tokens, s0, annotations, mask, params):
    """Logits (B, T, V) of `BahdanauSeq2Seq.step`, run T times from `s0` on the previous tokens `tokens` (B, T)."""
    model = held_decoder(params)
    projected = model.attention.project_keys(annotations)  # U_a h_j, the same at every step
    state, logits = s0, []
    for i in range(tokens.shape[1]):
        step_logits, _, state = model.step(tokens[:, i], state, annotations, mask, projected)
        logits.append(step_logits)
    return torch.stack(logits, dim=1)


def _shortcut_module(tokens, s0, annotations, mask, params):
    """The package's decoder holding the same weights: must be refused."""
    model = BahdanauSeq2Seq(Seq2SeqConfig(num_digits=params["E"].shape[0] - 2, embed_size=params["E"].shape[1],
                                          encoder_size=params["U_a"].shape[1] // 2,
                                          decoder_size=params["W_a"].shape[1], attention_size=params["W_a"].shape[0],
                                          maxout_size=params["W_out"].shape[1])).double()
    with torch.no_grad():
        for key, (where, name) in PLACES.items():
            getattr(model.get_submodule(where), name).copy_(params[key][None] if key == "v_a" else params[key])
    state, logits = s0, []
    projected = model.attention.project_keys(annotations)
    for i in range(tokens.shape[1]):
        step_logits, _, state = model.step(tokens[:, i], state, annotations, mask, projected)
        logits.append(step_logits)
    return torch.stack(logits, dim=1)


def _shortcut_attention(tokens, s0, annotations, mask, params):
    """The package's additive attention for the context, the rest by hand: must be refused."""
    from attncourse.rnn_attention import AdditiveAttention

    p = params
    attn = AdditiveAttention(p["W_a"].shape[1], p["U_a"].shape[1], p["W_a"].shape[0]).double()
    with torch.no_grad():
        attn.query_proj.weight.copy_(p["W_a"])
        attn.key_proj.weight.copy_(p["U_a"])
        attn.v.weight.copy_(p["v_a"][None])
    cell = torch.nn.GRUCell(p["W_ih"].shape[1], p["W_hh"].shape[1]).double()
    with torch.no_grad():
        for name, key in (("weight_ih", "W_ih"), ("weight_hh", "W_hh"), ("bias_ih", "b_ih"), ("bias_hh", "b_hh")):
            getattr(cell, name).copy_(p[key])
    state, logits = s0, []
    for i in range(tokens.shape[1]):
        y = p["E"][tokens[:, i]]
        context, _ = attn(state, annotations, mask=mask)
        t = (state @ p["U_o"].T + p["b_o"] + y @ p["V_o"].T + context @ p["C_o"].T).unflatten(-1, (-1, 2)).amax(-1)
        logits.append(t @ p["W_out"].T + p["b_out"])
        state = cell(torch.cat([y, context], -1), state)
    return torch.stack(logits, dim=1)


def draw_case(gen, b, t, s, lengths, vocab=7, embed=3, key=4, decoder=5, attention=4, maxout=3, scale=1.0):
    """(tokens (B, T), s0 (B, Dd), annotations (B, S, 2E), mask (B, S), params) in float64, annotations zero at
    padding as an encoder's are."""
    def w(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale / shape[-1] ** 0.5

    params = {"E": torch.randn(vocab, embed, generator=gen, dtype=torch.float64), "W_a": w(attention, decoder),
              "U_a": w(attention, key), "v_a": w(attention), "W_ih": w(3 * decoder, embed + key),
              "W_hh": w(3 * decoder, decoder), "b_ih": w(3 * decoder), "b_hh": w(3 * decoder),
              "U_o": w(2 * maxout, decoder), "b_o": w(2 * maxout), "V_o": w(2 * maxout, embed),
              "C_o": w(2 * maxout, key), "W_out": w(vocab, maxout), "b_out": w(vocab)}
    mask = torch.arange(s) < torch.tensor(lengths)[:, None]  # (B, S)
    annotations = torch.randn(b, s, key, generator=gen, dtype=torch.float64) * mask[..., None]
    tokens = torch.randint(2, vocab, (b, t), generator=gen)
    tokens[:, 0] = 1  # y_0: the start token
    s0 = torch.tanh(torch.randn(b, decoder, generator=gen, dtype=torch.float64))
    return tokens, s0, annotations, mask, params


@exercise("01-bahdanau-decoder", "bahdanau_decoder", points=3, category="implement",
          forbid=("attncourse.bahdanau.BahdanauSeq2Seq", "attncourse.rnn_attention.AdditiveAttention",
                  "attncourse.rnn_attention.attend", "attncourse.sdpa.safe_softmax", *graphs.NO_CUSTOM_GRADIENT),
          allow=(), ops=("attention",), shortcuts=(_shortcut_module, _shortcut_attention),
          prop_doc="output equality at every step, and the gradients: the logits of step i depend on which state "
                   "asks (s_{i-1}, not s_i), on the context entering the GRU (which changes s_i and so every later "
                   "step) and on which state the deep output reads, and each case with T >= 2 tells these "
                   "arrangements apart; two cases ask for the gradients of the first state and the annotations for "
                   "one fixed upstream gradient, which pass through every weight of the step, so a state cut off "
                   "from autograd between steps fails there, as does anything computed outside PyTorch",
          hint="at output step i, list what exists before the GRU runs: s_{i-1}, the previous token's embedding and "
               "(once the score has asked) c_i. Which state asks? What does the GRU read besides the token? Which "
               "state does the deep output read, the one before or after this step's GRU update? Padded positions "
               "get no weight.")
def _bahdanau_decoder():
    """Bahdanau et al.'s attention decoder (appendix A.2.2), teacher-forced over T steps from a given first state."""
    gen = torch.Generator().manual_seed(29)
    cases = []
    for name, size in {
        "one step (T=1): s_0 asks, the deep output reads s_0, E y_0 and c_1": (2, 1, 5, [5, 5]),
        "steps 1-2 (T=2): step 2 asks with s_1, which read c_1": (3, 2, 6, [6, 6, 6]),
        "padded annotations (lengths 7, 4, 1 of S=7): padded positions get no weight": (3, 4, 7, [7, 4, 1]),
        "B=1, T=5 over S=3": (1, 5, 3, [3]),
        "larger weights (the tanh and the maxout away from their linear range)": (2, 3, 6, [6, 5], 3.0),
    }.items():
        b, t, s, lengths, *scale = size
        args = draw_case(gen, b, t, s, lengths, scale=scale[0] if scale else 1.0)
        with torch.no_grad():
            cases.append(Case(name, args, expected=reference_logits(*args), rtol=1e-8, atol=1e-10))
    for b, t, s, lengths in ((2, 3, 5, [5, 3]), (3, 4, 6, [6, 2, 5])):  # training: gradients through every step
        args = draw_case(gen, b, t, s, lengths)
        cases.append(graphs.backward_case(f"the backward pass: gradients of s_0 and the annotations (B={b}, T={t}, "
                                          f"S={s})", args, reference_logits))
    return cases
