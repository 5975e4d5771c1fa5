r"""Attention over image patches: patchify / unpatchify, a synthetic shapes data set, and a tiny ViT.

A Vision Transformer (Dosovitskiy et al., 2021) cuts an image (C, H, W) into N = (H/p)(W/p) patches of
p x p pixels, flattens each into a vector of C p^2 numbers, projects it to d_model (the *patch embedding*),
prepends a learned **CLS** token, adds **learned position** vectors, and runs Transformer blocks. The class
is read from the CLS token's final state, so the CLS token's attention over the patches shows where the
model looks.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _validate
from .transformer import TransformerBlock

SHAPES = ("horizontal bar", "vertical bar", "box", "plus")


def _check_images(images: torch.Tensor, patch_size: int) -> None:
    _validate.tensor("images", images, min_rank=4)
    _validate.positive_int("patch_size", patch_size)
    if images.dim() != 4 or images.shape[-1] % patch_size or images.shape[-2] % patch_size:
        raise ValueError(f"images must be (B, C, H, W) with H and W divisible by patch_size={patch_size}, "
                         f"got shape {tuple(images.shape)}")


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C*p*p): patches in row-major order, each flattened as (C, p, p).

    N = (H/p) (W/p); patch n covers rows (n // (W/p)) p .. and columns (n % (W/p)) p ..; the same layout as
    ``F.unfold(images, p, stride=p).transpose(1, 2)``.
    """
    _check_images(images, patch_size)
    b, c, h, w = images.shape
    p = patch_size
    x = images.reshape(b, c, h // p, p, w // p, p)  # (B, C, H/p, p, W/p, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, H/p, W/p, C, p, p)
    return x.reshape(b, (h // p) * (w // p), c * p * p)  # (B, N, C p^2)


def unpatchify(patches: torch.Tensor, patch_size: int, height: int, width: int) -> torch.Tensor:
    """(B, N, C*p*p) -> (B, C, height, width): the inverse of :func:`patchify`."""
    _validate.tensor("patches", patches, min_rank=3)
    for name, v in (("patch_size", patch_size), ("height", height), ("width", width)):
        _validate.positive_int(name, v)
    p = patch_size
    if patches.dim() != 3 or height % p or width % p or patches.shape[1] != (height // p) * (width // p) \
            or patches.shape[2] % (p * p):
        raise ValueError(f"patches must be (B, (height/p)(width/p), C*p*p) for height={height}, width={width}, "
                         f"patch_size={p}, got shape {tuple(patches.shape)}")
    b, _, cpp = patches.shape
    c = cpp // (p * p)
    x = patches.reshape(b, height // p, width // p, c, p, p)  # (B, H/p, W/p, C, p, p)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)  # (B, C, H/p, p, W/p, p) -> (B, C, H, W)


def shape_images(n: int, size: int = 16, *, noise: float = 0.3, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` grey images (n, 1, size, size) each holding one of :data:`SHAPES` at a random place, on noise.

    Returns images (float32, shape pixels 1 plus Gaussian noise of std `noise`), labels (n,) int64
    (index into SHAPES), and the boolean shape masks (n, size, size).
    """
    _validate.positive_int("n", n)
    _validate.positive_int("size", size)
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels, got {size}")
    labels = torch.randint(0, len(SHAPES), (n,), generator=generator)  # (n,)
    masks = torch.zeros(n, size, size, dtype=torch.bool)
    ext = 6  # every shape fits a 6 x 6 box (bars: 6 x 2)
    corner = torch.randint(0, size - ext + 1, (n, 2), generator=generator)  # (n, 2) top-left corners
    for i in range(n):
        r, c = corner[i].tolist()
        box = masks[i, r:r + ext, c:c + ext]  # (6, 6) view
        kind = SHAPES[labels[i]]
        if kind == "horizontal bar":
            box[2:4, :] = True
        elif kind == "vertical bar":
            box[:, 2:4] = True
        elif kind == "box":
            box[[0, -1], :] = True
            box[:, [0, -1]] = True
        else:  # plus
            box[2:4, 1:5] = True
            box[1:5, 2:4] = True
    images = masks.float() + noise * torch.randn(n, size, size, generator=generator)  # (n, H, W)
    return images[:, None], labels, masks  # (n, 1, H, W)


class TinyViT(nn.Module):
    """A small Vision Transformer: images (B, C, H, W) -> class logits (B, n_classes).

    Patch embedding (a linear map of each flattened patch), a learned CLS token, learned positions
    ((N + 1, d_model)), pre-norm :class:`~attncourse.TransformerBlock` s, and a linear head on the CLS state.
    ``forward(images, return_attention=True)`` also returns the CLS token's attention over the patches,
    (B, n_layers, H, N).
    """

    def __init__(self, image_size: int = 16, patch_size: int = 4, channels: int = 1, n_classes: int = 4, *,
                 d_model: int = 32, n_heads: int = 4, n_layers: int = 2):
        super().__init__()
        for name, v in (("image_size", image_size), ("patch_size", patch_size), ("channels", channels),
                        ("n_classes", n_classes), ("d_model", d_model), ("n_heads", n_heads),
                        ("n_layers", n_layers)):
            _validate.positive_int(name, v)
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} must be divisible by patch_size={patch_size}")
        self.image_size, self.patch_size, self.channels = image_size, patch_size, channels
        self.n_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(channels * patch_size ** 2, d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(1, self.n_patches + 1, d_model) * 0.02)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, 2 * d_model, norm_first=True,
                                                     activation="gelu") for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, images: torch.Tensor, *, return_attention: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """images (B, C, S, S) -> logits (B, n_classes) [, CLS attention (B, n_layers, H, N)]."""
        _check_images(images, self.patch_size)
        want = (self.channels, self.image_size, self.image_size)
        if tuple(images.shape[1:]) != want:
            raise ValueError(f"images must be (B, {', '.join(map(str, want))}), got shape {tuple(images.shape)}")
        x = self.patch_embed(patchify(images, self.patch_size))  # (B, N, C p^2) -> (B, N, d)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (B, N + 1, d)
        cls_attn = []
        for block in self.blocks:
            x, w = block(x, return_weights=True)  # (B, N + 1, d), (B, H, N + 1, N + 1)
            cls_attn.append(w[:, :, 0, 1:])  # (B, H, N): query = CLS, keys = the patches
        logits = self.head(self.norm(x[:, 0]))  # (B, d) -> (B, n_classes)
        return (logits, torch.stack(cls_attn, dim=1)) if return_attention else logits  # (B, L, H, N)

    @torch.no_grad()
    def attention_maps(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, S, S) -> every block's full attention maps (B, n_layers, H, N + 1, N + 1), CLS first.
        Raises ValueError for images of the wrong shape."""
        _check_images(images, self.patch_size)
        x = self.patch_embed(patchify(images, self.patch_size))  # (B, N, d)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (B, N + 1, d)
        maps = []
        for block in self.blocks:
            x, w = block(x, return_weights=True)  # (B, N + 1, d), (B, H, N + 1, N + 1)
            maps.append(w)
        return torch.stack(maps, dim=1)  # (B, L, H, N + 1, N + 1)


def attention_rollout(maps: torch.Tensor, residual: float = 0.5) -> torch.Tensor:
    r"""Attention rollout (Abnar and Zuidema, 2020): how much each input token flows into each output token through
    all layers, counting the residual connection.

    Each layer's map, averaged over heads, becomes :math:`\hat A_l = (1 - r) \bar A_l + r I` (rows still sum to 1),
    and the layers compose by matrix product: :math:`\tilde A = \hat A_L \cdots \hat A_1`.

    Args:
        maps: (B, L, H, T, T) attention maps of L layers, rows summing to 1 (e.g. :meth:`TinyViT.attention_maps`).
        residual: r in [0, 1), the weight given to the identity (0.5 in the paper).
    Returns (B, T, T): row i is how much of output token i comes from each input token (rows sum to 1).
    Raises ValueError for maps not of shape (B, L, H, T, T) or a residual outside [0, 1).
    """
    _validate.tensor("maps", maps, floating=True)
    if maps.dim() != 5 or maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"maps must be (B, L, H, T, T), got shape {tuple(maps.shape)}")
    if not 0.0 <= residual < 1.0:
        raise ValueError(f"residual must be in [0, 1), got {residual}")
    eye = torch.eye(maps.shape[-1], dtype=maps.dtype, device=maps.device)  # (T, T)
    flow = eye.expand(maps.shape[0], -1, -1)  # (B, T, T)
    for layer in range(maps.shape[1]):
        a = (1 - residual) * maps[:, layer].mean(dim=1) + residual * eye  # (B, T, T): heads averaged, residual added
        flow = a @ flow  # (B, T, T) @ (B, T, T): this layer on top of the ones below
    return flow
