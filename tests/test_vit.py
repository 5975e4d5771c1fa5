"""patchify / unpatchify against F.unfold / F.fold, the shapes data set, and the tiny ViT."""

import pytest
import torch
import torch.nn.functional as F

from attncourse import TinyViT, patchify, shape_images, unpatchify
from attncourse.vit import SHAPES


@pytest.mark.parametrize("b, c, h, w, p", [(2, 1, 16, 16, 4), (3, 3, 12, 8, 4), (1, 2, 10, 15, 5), (2, 1, 7, 7, 1),
                                           (1, 3, 6, 6, 6)])
def test_patchify_matches_unfold_and_round_trips(b, c, h, w, p):
    x = torch.randn(b, c, h, w, dtype=torch.float64)
    patches = patchify(x, p)
    assert patches.shape == (b, (h // p) * (w // p), c * p * p)
    torch.testing.assert_close(patches, F.unfold(x, p, stride=p).transpose(1, 2), rtol=0, atol=0)
    assert torch.equal(unpatchify(patches, p, h, w), x)
    torch.testing.assert_close(unpatchify(patches, p, h, w), F.fold(patches.transpose(1, 2), (h, w), p, stride=p))


def test_patch_order_is_row_major():
    x = torch.arange(16.0).view(1, 1, 4, 4)
    p = patchify(x, 2)
    assert p[0, 0].tolist() == [0, 1, 4, 5] and p[0, 1].tolist() == [2, 3, 6, 7] and p[0, 2].tolist() == [8, 9, 12, 13]


def test_patchify_bad_input():
    with pytest.raises(ValueError, match=r"divisible by patch_size=3.*\(1, 1, 16, 16\)"):
        patchify(torch.zeros(1, 1, 16, 16), 3)
    with pytest.raises(ValueError, match="at least 4 dims"):
        patchify(torch.zeros(16, 16), 4)
    with pytest.raises(TypeError, match="images"):
        patchify([[0.0]], 4)
    with pytest.raises(ValueError, match="patches must be"):
        unpatchify(torch.zeros(1, 15, 16), 4, 16, 16)
    with pytest.raises(ValueError, match="patch_size"):
        patchify(torch.zeros(1, 1, 4, 4), 0)


def test_shape_images():
    x, y, m = shape_images(40, 16, noise=0.0, generator=torch.Generator().manual_seed(0))
    assert x.shape == (40, 1, 16, 16) and y.shape == (40,) and m.shape == (40, 16, 16)
    assert torch.equal(x[:, 0], m.float())  # no noise: the image is the mask
    assert set(y.tolist()) == set(range(len(SHAPES)))
    counts = {"horizontal bar": 12, "vertical bar": 12, "box": 20, "plus": 12}
    for i in range(40):
        assert m[i].sum().item() == counts[SHAPES[y[i]]]
        rows, cols = m[i].nonzero().unbind(1)
        assert rows.max() - rows.min() < 6 and cols.max() - cols.min() < 6
    with pytest.raises(ValueError, match="size"):
        shape_images(2, 6)


def test_tiny_vit_shapes_attention_and_gradients():
    torch.manual_seed(0)
    m = TinyViT(image_size=12, patch_size=4, channels=3, n_classes=5, d_model=16, n_heads=2, n_layers=3)
    x = torch.randn(4, 3, 12, 12)
    logits, att = m(x, return_attention=True)
    assert logits.shape == (4, 5) and att.shape == (4, 3, 2, 9)
    assert (att.sum(-1) <= 1 + 1e-6).all() and (att >= 0).all()  # CLS -> patches (CLS -> CLS left out)
    torch.testing.assert_close(m(x), logits)
    F.cross_entropy(logits, torch.arange(4)).backward()
    assert all(p.grad is not None for p in m.parameters())


def test_tiny_vit_is_permutation_sensitive_through_positions_only():
    torch.manual_seed(0)
    m = TinyViT(d_model=16, n_heads=2)
    x = torch.randn(2, 1, 16, 16)
    flipped = x.flip(-1)
    assert not torch.allclose(m(x), m(flipped))
    with torch.no_grad():
        m.pos.zero_()  # no positions: a permutation of the patches leaves the CLS output unchanged
    perm = torch.randperm(16)
    shuffled = unpatchify(patchify(x, 4)[:, perm], 4, 16, 16)
    torch.testing.assert_close(m(shuffled), m(x), rtol=1e-5, atol=1e-6)


def test_tiny_vit_bad_input():
    m = TinyViT()
    with pytest.raises(ValueError, match=r"\(B, 1, 16, 16\)"):
        m(torch.zeros(2, 3, 16, 16))
    with pytest.raises(ValueError, match="divisible"):
        TinyViT(image_size=10, patch_size=4)
