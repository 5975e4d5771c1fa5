"""M-RoPE against a transcription of Hugging Face's Qwen2-VL code, its 2-D relative property, the position ids of
text and images, and packed documents (position ids restart, the document mask), with bad input."""

import pytest
import torch
import torch.nn.functional as F

from attncourse.mrope import apply_mrope, document_causal, mrope_position_ids, packed_position_ids
from attncourse.positions import apply_rope


def hf_multimodal_rope(x, position_ids, mrope_section, base=10000.0):
    """Transcribed from transformers' Qwen2-VL: the rotary embedding of each of the three id rows, then
    ``apply_multimodal_rotary_pos_emb`` (sections doubled, chunk i takes row i % 3)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = position_ids[..., None].double() * inv_freq          # (3, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                       # (3, T, D)
    section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(emb.cos().split(section, dim=-1))], dim=-1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(emb.sin().split(section, dim=-1))], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def test_matches_hugging_face_and_reduces_to_rope_on_text():
    ids = mrope_position_ids([("text", 5), ("image", (3, 4)), ("text", 3)])
    x = torch.randn(2, 4, ids.shape[1], 32, dtype=torch.float64)
    torch.testing.assert_close(apply_mrope(x, ids, [4, 6, 6]), hf_multimodal_rope(x, ids, [4, 6, 6]))
    text = torch.arange(9).expand(3, 9)
    y = torch.randn(3, 9, 32)
    torch.testing.assert_close(apply_mrope(y, text, (4, 6, 6)), apply_rope(y, torch.arange(9)))


def test_position_ids_of_text_and_image():
    ids = mrope_position_ids([("text", 2), ("image", (2, 3)), ("text", 2)])
    assert ids.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]


def test_image_scores_depend_on_the_2d_offset_only():
    q, k = torch.randn(2, 1, 64, dtype=torch.float64).unbind(0)

    def score(a, b):  # patches a = (row, col), b = (row, col) of one image placed at offset 7
        ids = torch.tensor([[7, 7], [7 + a[0], 7 + b[0]], [7 + a[1], 7 + b[1]]])
        qq = apply_mrope(torch.cat([q, k]), ids, [8, 12, 12])
        return (qq[0] @ qq[1]).item()

    assert score((5, 2), (3, 1)) == pytest.approx(score((9, 6), (7, 5)), abs=1e-9)   # offset (2, 1) anywhere
    assert abs(score((5, 2), (3, 1)) - score((5, 2), (4, 8))) > 1e-3                  # other 2-D offset


def test_packing():
    lengths = [3, 5, 2]
    assert packed_position_ids(lengths).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    keep = document_causal(lengths)
    assert keep.shape == (10, 10) and keep[4, 3] and not keep[4, 2] and not keep[3, 4] and keep[9, 8]
    q, k, v = torch.randn(3, 1, 2, 10, 16, dtype=torch.float64).unbind(0)
    pos = packed_position_ids(lengths)
    packed = F.scaled_dot_product_attention(apply_rope(q, pos), apply_rope(k, pos), v, attn_mask=keep)
    start = 0
    for n in lengths:  # each document alone, positions from 0
        sl = slice(start, start + n)
        alone = F.scaled_dot_product_attention(apply_rope(q[..., sl, :]), apply_rope(k[..., sl, :]), v[..., sl, :],
                                               is_causal=True)
        torch.testing.assert_close(packed[..., sl, :], alone)
        start += n


def test_bad_input():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="position_ids"):
        apply_mrope(x, torch.zeros(2, 4, dtype=torch.long), [2, 3, 3])
    with pytest.raises(ValueError, match="sections"):
        apply_mrope(x, torch.zeros(3, 4, dtype=torch.long), [2, 3, 4])
    with pytest.raises(TypeError, match="position_ids"):
        apply_mrope(x, torch.zeros(3, 4), [2, 3, 3])
    with pytest.raises(ValueError, match="segment kind"):
        mrope_position_ids([("audio", 3)])
    with pytest.raises(ValueError, match="lengths"):
        packed_position_ids([3, 0])
