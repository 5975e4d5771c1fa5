"""Chapter 02's local-p exercise (checks/ch02_localp.py): the module's weights pass, each misreading of Luong et al.'s
eqs. 9-10 fails, and a predicted position cut off from autograd fails the backward cases."""

import torch

from test_ch01_checks import accepted, refused


def _weights(queries, keys, lengths, W, W_p, v_p, window, *, sigma=None, renormalise=False, whole_row=False,
             padded_length=False, detach=False):
    T = keys.shape[1]
    S = (torch.full_like(lengths, T) if padded_length else lengths).to(queries.dtype)[:, None]
    p = S * torch.sigmoid(torch.tanh(queries @ W_p.T) @ v_p)
    p = p.detach() if detach else p
    offset = torch.arange(T, dtype=queries.dtype) - p[..., None]
    real = (torch.arange(T) < lengths[:, None])[:, None]
    inside = real if whole_row else (offset.abs() <= window) & real
    align = torch.softmax((queries @ W @ keys.transpose(1, 2)).masked_fill(~inside, float("-inf")), -1)
    w = align * torch.exp(-offset**2 / (2 * (sigma or window / 2) ** 2))
    return w / w.sum(-1, keepdim=True) if renormalise else w


def test_local_p_routes(tmp_path, monkeypatch):
    accepted("02-local-p", lambda *a: _weights(*a), tmp_path, monkeypatch)
    for wrong in ({"sigma": 0}, {"renormalise": True}, {"whole_row": True}, {"padded_length": True}):
        if wrong == {"sigma": 0}:  # sigma = D, the window's half-width, instead of D / 2
            answer = lambda *a: _weights(*a, sigma=a[-1])  # noqa: E731
        else:
            answer = lambda *a, wrong=wrong: _weights(*a, **wrong)  # noqa: E731
        refused("02-local-p", answer, tmp_path, monkeypatch, why="case “")
    refused("02-local-p", lambda *a: _weights(*a, detach=True), tmp_path, monkeypatch, why="the backward pass")


def test_local_p_refuses_torchs_masked_softmax(tmp_path, monkeypatch):
    """The cold review's route (review 15): eqs. 9-10 written out but the window's softmax by torch.masked.softmax
    passed here while 01-padding-mask refused it. Both now refuse PyTorch's masked softmaxes."""
    def masked_api(queries, keys, lengths, W, W_p, v_p, window, log=False):
        T = keys.shape[1]
        p = lengths[:, None].to(queries.dtype) * torch.sigmoid(torch.tanh(queries @ W_p.T) @ v_p)
        offset = torch.arange(T, dtype=queries.dtype) - p[..., None]
        keep = (offset.abs() <= window) & (torch.arange(T) < lengths[:, None])[:, None]
        scores = queries @ W @ keys.transpose(1, 2)
        align = (torch.masked.log_softmax(scores, -1, mask=keep).exp() if log
                 else torch.masked.softmax(scores, -1, mask=keep))
        return torch.where(keep, align, 0.0) * torch.exp(-offset**2 / (2 * (window / 2) ** 2))

    refused("02-local-p", masked_api, tmp_path, monkeypatch)
    refused("02-local-p", lambda *a: masked_api(*a, log=True), tmp_path, monkeypatch)
