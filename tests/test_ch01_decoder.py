"""Chapter 01's decoder exercise (checks/ch01_decoder.py): Bahdanau et al.'s arrangement passes; each other arrangement
(the course's own decoder order, the context kept out of the GRU, the deep output reading the new state, maxout over
halves, no mask) fails a forward case, and a state cut off from autograd between steps fails the backward cases."""

import pytest
import torch

from attncourse.classroom import checks
from test_ch01_checks import accepted, refused
from test_exercise_standard import as_learner


def _decoder(tokens, s0, annotations, mask, p, *, new_state_asks=False, context_in_gru=True, output_reads_new=False,
             halves=False, masked=True, detach=False):
    def gru(x, h):
        x_r, x_z, x_n = (x @ p["W_ih"].T + p["b_ih"]).chunk(3, -1)
        h_r, h_z, h_n = (h @ p["W_hh"].T + p["b_hh"]).chunk(3, -1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        return (1 - z) * torch.tanh(x_n + r * h_n) + z * h

    def context(query):
        e = torch.tanh((query @ p["W_a"].T)[:, None] + annotations @ p["U_a"].T) @ p["v_a"]
        alpha = torch.softmax(e.masked_fill(~mask, float("-inf")) if masked else e, -1)
        return (alpha[..., None] * annotations).sum(1)

    state, out = s0, []
    for i in range(tokens.shape[1]):
        y = p["E"][tokens[:, i]]
        if new_state_asks:  # the course's decoder: the GRU first, then the new state asks
            new = gru(torch.cat([y, torch.zeros_like(annotations[:, 0])], -1), state)
            c = context(new)
        else:
            c = context(state)
            new = gru(torch.cat([y, c if context_in_gru else torch.zeros_like(c)], -1), state)
        t = (new if output_reads_new else state) @ p["U_o"].T + p["b_o"] + y @ p["V_o"].T + c @ p["C_o"].T
        t = t.unflatten(-1, (2, -1)).amax(-2) if halves else t.unflatten(-1, (-1, 2)).amax(-1)
        out.append(t @ p["W_out"].T + p["b_out"])
        state = new.detach() if detach else new
    return torch.stack(out, 1)


def test_bahdanau_decoder_routes(tmp_path, monkeypatch):
    accepted("01-bahdanau-decoder", lambda *a: _decoder(*a), tmp_path, monkeypatch)
    refused("01-bahdanau-decoder", lambda *a: _decoder(*a, new_state_asks=True), tmp_path, monkeypatch, why="case “")
    refused("01-bahdanau-decoder", lambda *a: _decoder(*a, detach=True), tmp_path, monkeypatch,
            why="the backward pass")
    for wrong in ({"context_in_gru": False}, {"output_reads_new": True}, {"halves": True}, {"masked": False}):
        with pytest.raises(checks.CheckFailed, match="case “"):  # the check cell is enough: the grader runs the same
            checks.check("01-bahdanau-decoder", as_learner(lambda *a, w=wrong: _decoder(*a, **w)))
