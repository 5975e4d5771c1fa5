"""Attention rollout (chapter 12, section 5) against Abnar and Zuidema's reference and against TinyViT's own maps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attncourse import TinyViT, shape_images
from attncourse.vit import attention_rollout


def reference_joint_attention(att_mat: np.ndarray) -> np.ndarray:
    """samiraabnar/attention_flow, compute_joint_attention(add_residual=True), on head-averaged maps (L, T, T):
    identity added, rows renormalised, layers multiplied from the bottom; returns the last layer's joint map."""
    aug = att_mat + np.eye(att_mat.shape[1])[None]
    aug = aug / aug.sum(axis=-1)[..., None]
    joint = aug[0]
    for layer in range(1, aug.shape[0]):
        joint = aug[layer] @ joint
    return joint


def random_maps(b, layers, heads, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, layers, heads, t, t, generator=g, dtype=torch.float64) * 2, dim=-1)


def test_rollout_equals_the_reference():
    maps = random_maps(3, 4, 2, 7)
    got = attention_rollout(maps)
    for i in range(3):
        expected = reference_joint_attention(maps[i].mean(dim=1).numpy())
        torch.testing.assert_close(got[i], torch.from_numpy(expected))
    torch.testing.assert_close(got.sum(-1), torch.ones(3, 7, dtype=torch.float64))


def test_one_layer_and_no_residual():
    maps = random_maps(2, 1, 3, 5, seed=1)
    torch.testing.assert_close(attention_rollout(maps), 0.5 * maps[:, 0].mean(1) + 0.5 * torch.eye(5, dtype=torch.float64))
    two = random_maps(2, 2, 1, 5, seed=2)
    torch.testing.assert_close(attention_rollout(two, residual=0.0), two[:, 1, 0] @ two[:, 0, 0])


def test_vit_maps_match_its_cls_attention():
    torch.manual_seed(0)
    vit = TinyViT(image_size=16, patch_size=4, channels=1, n_classes=4, d_model=16, n_heads=2, n_layers=2).eval()
    images = shape_images(5, generator=torch.Generator().manual_seed(3))[0]
    with torch.no_grad():
        _, cls_attn = vit(images, return_attention=True)  # (B, L, H, N)
    maps = vit.attention_maps(images)  # (B, L, H, N + 1, N + 1)
    assert maps.shape == (5, 2, 2, 17, 17)
    torch.testing.assert_close(maps[..., 0, 1:], cls_attn)


def test_rollout_rejects_bad_input():
    with pytest.raises(ValueError, match="maps"):
        attention_rollout(torch.rand(2, 3, 4, 4))
    with pytest.raises(ValueError, match="residual"):
        attention_rollout(random_maps(1, 1, 1, 3), residual=1.0)
    with pytest.raises(TypeError, match="maps"):
        attention_rollout([[1.0]])
