r"""Where FlashAttention's tiles go and what they cost in slow-memory traffic: the band geometry the tiled loops
share (:class:`Band`), tile maps, the HBM-traffic models of standard attention and of FlashAttention's two loop
orders, the bound of Theorem 2, and a counter that the tiled loop of :mod:`attncourse.flash` reports its loads and
stores to (:class:`TrafficCounter`), so the model can be compared with a measurement of the code.

**Geometry.** Query row ``i`` sits at the aligned position ``p = i + offset`` and key ``j`` at position ``j``
(``offset = 0`` is PyTorch's top-left ``is_causal``; ``Tk - Tq`` is bottom-right; a ring or block-sparse loop
that calls the kernel on one block adds the blocks' start positions). Causally row ``i`` sees keys ``j <= p``;
with a window ``W`` only ``p - W < j <= p`` (``W`` keys, itself included: FlashAttention's
``window_size=(W - 1, 0)``). A tile is *empty* (skipped: never loaded), *partial* (loaded and masked) or *full*
(loaded, no mask).

**Traffic models** count elements read from and written to slow memory ("HBM") by one forward of one (batch,
head) with sequence length N, head dim d and on-chip memory of M elements (Dao et al. 2022, Theorem 2;
Dao 2023, FlashAttention-2, section 3.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _validate

ALIGNS = ("top_left", "bottom_right")


def check_causal_options(is_causal, causal_align: str, window: int | None) -> int | None:
    """Validate the causal options shared by chapter 09's tiles and chapter 10's kernels; return the window."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if causal_align not in ALIGNS:
        raise ValueError(f"causal_align must be one of {ALIGNS}, got {causal_align!r}")
    if window is not None:
        window = _validate.positive_int("window", window)
        if not is_causal:
            raise ValueError(f"window={window} needs is_causal=True (the window is the last `window` keys up to "
                             f"the query's aligned position), got is_causal=False")
    return window

__all__ = ["ALIGNS", "Band", "HBMTraffic", "TrafficCounter", "causal_block_counts", "causal_tile_map", "check_causal_options",
           "check_int", "check_qkv",
           "flash_block_sizes",
           "hbm_traffic_fa2", "hbm_traffic_flash", "hbm_traffic_standard",
           "hbm_traffic_standard_backward", "theorem2_bound", "tile_map"]


# ----------------------------------------------------------------------------- the band of allowed pairs


@dataclass(frozen=True)
class Band:
    """Which (query row, key) pairs are allowed: all (``causal=False``), or ``j <= i + offset`` and, with a
    window ``W``, ``j > i + offset - W``. Row and key indices are local to the tensors the loop runs on."""

    causal: bool = False
    offset: int = 0
    window: int | None = None

    def key_range(self, q0: int, q1: int, t_k: int, block_k: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that rows ``q0 .. q1 - 1`` may see; ``lo`` is a multiple of `block_k` (the tile grid)."""
        if not self.causal:
            return 0, t_k
        hi = max(min(t_k, q1 - 1 + self.offset + 1), 0)  # keys after the last row's position: never loaded
        lo = 0
        if self.window is not None:  # keys before the first row's window: never loaded
            lo = max(q0 + self.offset - self.window + 1, 0) // block_k * block_k
        return lo, hi

    def query_range(self, k0: int, k1: int, t_q: int, block_q: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` that see some key of ``k0 .. k1 - 1``; ``lo`` is a multiple of `block_q`."""
        if not self.causal:
            return 0, t_q
        lo = max(k0 - self.offset, 0) // block_q * block_q  # rows placed before the first key see none of them
        hi = t_q
        if self.window is not None:  # rows whose window has moved past the last key
            hi = max(min(t_q, k1 - 1 + self.window - self.offset), 0)
        return lo, hi

    def full(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """True when every pair of rows ``q0 .. q1 - 1`` and keys ``k0 .. k1 - 1`` is allowed (no mask needed)."""
        if not self.causal:
            return True
        ok = k1 - 1 <= q0 + self.offset  # the last key is visible to the first row
        if self.window is not None:
            ok = ok and k0 > q1 - 1 + self.offset - self.window  # the first key is inside the last row's window
        return ok

    def allowed(self, q0: int, q1: int, k0: int, k1: int, device=None) -> torch.Tensor:
        """(q1 - q0, k1 - k0) boolean, True where the row may see the key."""
        if not self.causal:
            return torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
        pos = torch.arange(q0, q1, device=device)[:, None] + self.offset  # (Bq, 1) aligned positions
        cols = torch.arange(k0, k1, device=device)[None, :]  # (1, Bk)
        keep = cols <= pos  # (Bq, Bk)
        if self.window is not None:
            keep &= cols > pos - self.window
        return keep

    def mask(self, t_q: int, t_k: int, device=None) -> torch.Tensor:
        """(Tq, Tk) boolean mask of the whole problem: what the oracle needs to give the same answer."""
        return self.allowed(0, t_q, 0, t_k, device)


def tile_map(t_q: int, t_k: int, block_q: int, block_k: int, band: Band | None = None) -> torch.Tensor:
    """(ceil(Tq/Bq), ceil(Tk/Bk)) int tensor of what the tiled loop does with each tile: 0 = skipped (no allowed
    pair, never loaded), 1 = loaded and partly masked, 2 = loaded whole (every pair allowed, no mask)."""
    for name, value in (("t_q", t_q), ("t_k", t_k), ("block_q", block_q), ("block_k", block_k)):
        _validate.positive_int(name, value)
    band = Band() if band is None else band
    n_q, n_k = -(-t_q // block_q), -(-t_k // block_k)
    tiles = torch.zeros(n_q, n_k, dtype=torch.long)
    for a, q0 in enumerate(range(0, t_q, block_q)):
        q1 = min(q0 + block_q, t_q)
        lo, hi = band.key_range(q0, q1, t_k, block_k)
        for k0 in range(lo, hi, block_k):
            tiles[a, k0 // block_k] = 2 if band.full(q0, q1, k0, min(k0 + block_k, t_k)) else 1
    return tiles


def causal_tile_map(q_len: int, k_len: int, block_q: int, block_k: int) -> torch.Tensor:
    """:func:`tile_map` of a top-left causal mask (query i sees keys 0..i): 0 skipped, 1 diagonal, 2 full."""
    _validate.positive_int("q_len", q_len)
    _validate.positive_int("k_len", k_len)
    return tile_map(q_len, k_len, block_q, block_k, Band(causal=True))


def causal_block_counts(q_len: int, k_len: int, block_q: int, block_k: int) -> dict[str, int]:
    """How many tiles a causal tiled pass skips, masks and computes whole: keys "total", "skipped",
    "diagonal", "full". For Tq = Tk = T and Bq = Bk = B the skipped fraction tends to 1/2 as T grows."""
    tiles = causal_tile_map(q_len, k_len, block_q, block_k)
    return {"total": tiles.numel(), "skipped": int((tiles == 0).sum()),
            "diagonal": int((tiles == 1).sum()), "full": int((tiles == 2).sum())}


# ----------------------------------------------------------------------------- validation of the shared signature


def check_qkv(query, key, value) -> None:
    """Shapes of the shared signature (grouped KV heads, dims before -3 broadcast), dtypes, devices."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, x, min_rank=2, floating=True)
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key and value must have the same rank, got {shapes}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share the head dim (dim -1), got {shapes}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length (dim -2), got {shapes}")
    if query.dim() >= 3:
        if key.shape[-3] != value.shape[-3]:
            raise ValueError(f"key and value must have the same number of heads (dim -3), got {shapes}")
        if key.shape[-3] == 0 or query.shape[-3] % key.shape[-3]:
            raise ValueError(f"the KV heads of key and value (dim -3) must divide the query heads (dim -3), "
                             f"got {shapes}")
        try:
            torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
        except RuntimeError:
            raise ValueError(f"the batch dims (before dim -3) do not broadcast: {shapes}") from None
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                         f"{value.device}")


def check_int(name: str, value: object) -> int:
    """Any int (negative allowed), not a bool."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


# ----------------------------------------------------------------------------- HBM traffic models


@dataclass(frozen=True)
class HBMTraffic:
    """Elements read from and written to slow memory ("HBM") by one attention forward."""

    reads: int
    writes: int
    block_r: int = 0  # query rows per tile (FlashAttention only)
    block_c: int = 0  # key columns per tile (FlashAttention only)

    @property
    def total(self) -> int:
        return self.reads + self.writes


def _model_args(seq_len: int, head_dim: int) -> None:
    _validate.positive_int("seq_len", seq_len)
    _validate.positive_int("head_dim", head_dim)


def hbm_traffic_standard(seq_len: int, head_dim: int) -> HBMTraffic:
    """Standard attention (Dao et al. 2022, Algorithm 0) on N = seq_len, d = head_dim.

    S = QK^T reads Q and K (2Nd) and writes S (N^2); the softmax reads S and writes P (N^2 each way);
    O = PV reads P and V (N^2 + Nd) and writes O (Nd). Reads 3Nd + 2N^2, writes 2N^2 + Nd: Theta(Nd + N^2).
    """
    _model_args(seq_len, head_dim)
    n, d = seq_len, head_dim
    return HBMTraffic(reads=2 * n * d + n * n + n * n + n * d, writes=n * n + n * n + n * d)


def flash_block_sizes(head_dim: int, sram: int) -> tuple[int, int]:
    """(B_r, B_c) of Algorithm 1 for on-chip memory of `sram` elements: B_c = ceil(M / 4d),
    B_r = min(ceil(M / 4d), d)."""
    _validate.positive_int("head_dim", head_dim)
    _validate.positive_int("sram", sram)
    block_c = -(-sram // (4 * head_dim))
    return min(block_c, head_dim), block_c


def _check_sram(head_dim: int, sram: int) -> None:
    _validate.positive_int("sram", sram)
    if sram < head_dim:
        raise ValueError(f"sram (M = {sram}) must hold at least one row of head_dim = {head_dim}")


def hbm_traffic_flash(seq_len: int, head_dim: int, sram: int) -> HBMTraffic:
    """FlashAttention-1's forward (Dao et al. 2022, Algorithm 1: key blocks outside, query blocks inside) with
    on-chip memory of M = `sram` elements.

    It writes O, l, m once to initialise them (Nd + 2N); each of the T_c = ceil(N / B_c) key blocks is
    read once (K_j, V_j: 2 B_c d), and for each of them every query block is read (Q_i, O_i, l_i, m_i)
    and written back (O_i, l_i, m_i). So about T_c (3Nd + 4N) = 12 N^2 d^2 / M + ... elements: the
    Theta(N^2 d^2 / M) of Theorem 2.
    """
    _model_args(seq_len, head_dim)
    _check_sram(head_dim, sram)
    n, d = seq_len, head_dim
    block_r, block_c = flash_block_sizes(d, sram)
    t_c = -(-n // block_c)
    reads = 2 * n * d + t_c * (2 * n * d + 2 * n)  # K, V once; Q, O, l, m once per key block
    writes = n * d + 2 * n + t_c * (n * d + 2 * n)  # initial O, l, m; O, l, m once per key block
    return HBMTraffic(reads=reads, writes=writes, block_r=block_r, block_c=block_c)


def hbm_traffic_fa2(seq_len: int, head_dim: int, sram: int | None = None, *, block_q: int | None = None,
                    block_k: int | None = None, is_causal: bool = False, key_len: int | None = None) -> HBMTraffic:
    """FlashAttention-2's forward (query blocks outside, key blocks inside), the loop order chapter 09 runs.

    Each query block Q_i is read once and stays on chip with its running max, sum and output; every key block
    it visits is read (K_j, V_j); at the end O_i and the row's lse are written once. Reads Nd + (key rows loaded)
    x 2d, writes Nd + N. Without causal skipping that is Nd + T_r 2Nd + Nd + N = 2Nd + 2N^2 d / B_r + N,
    and with B_r about M / 4d it is 8 N^2 d^2 / M + ...: still Theta(N^2 d^2 / M), a smaller constant than
    FlashAttention-1's 12 because O, l and m never go back and forth.

    Give `sram` (block sizes as :func:`flash_block_sizes`, with ``B_r = B_c``) or both `block_q` and `block_k`
    (the tiles the chapter's loop really uses). ``is_causal`` skips the tiles above the diagonal (top-left);
    `key_len` defaults to `seq_len`.
    """
    _model_args(seq_len, head_dim)
    n, d = seq_len, head_dim
    t_k = n if key_len is None else _validate.positive_int("key_len", key_len)
    if (block_q is None) != (block_k is None) or (sram is None) == (block_q is None):
        raise ValueError(f"give either sram or both block_q and block_k, got sram={sram}, block_q={block_q}, "
                         f"block_k={block_k}")
    if sram is not None:
        _check_sram(d, sram)
        block_q = block_k = flash_block_sizes(d, sram)[1]
    band = Band(causal=is_causal)
    kv_reads = 0
    for q0 in range(0, n, block_q):  # each query block loads the key blocks [lo, hi) it can see, K_j and V_j
        lo, hi = band.key_range(q0, min(q0 + block_q, n), t_k, block_k)
        kv_reads += 2 * max(hi - lo, 0) * d
    return HBMTraffic(reads=n * d + kv_reads, writes=n * d + n, block_r=block_q, block_c=block_k)


def hbm_traffic_standard_backward(seq_len: int, head_dim: int) -> HBMTraffic:
    """The backward of standard attention (Dao et al. 2022, Algorithm 3: the backward with P stored) on
    N = seq_len, d = head_dim, one head, no mask and no dropout.

    dV = P^T dO reads P and dO, writes dV; dP = dO V^T reads dO and V, writes dP (N x N); dS = P * (dP - D) reads
    P and dP, writes dS (N x N); dQ = dS K and dK = dS^T Q each read dS and one of K, Q and write an N x d
    gradient. Reads 5N^2 + 5Nd, writes 2N^2 + 3Nd.

    Raises:
        ValueError: `seq_len` or `head_dim` not a positive int.
    """
    _model_args(seq_len, head_dim)
    n, d = seq_len, head_dim
    return HBMTraffic(reads=5 * n * n + 5 * n * d, writes=2 * n * n + 3 * n * d)


def theorem2_bound(seq_len: int, head_dim: int, sram: int) -> float:
    """N^2 d^2 / M: the order of FlashAttention's HBM accesses (Theorem 2), without its constant."""
    _model_args(seq_len, head_dim)
    _validate.positive_int("sram", sram)
    return seq_len**2 * head_dim**2 / sram


# ----------------------------------------------------------------------------- a counter the tiled loop reports to


@dataclass
class TrafficCounter:
    """Elements the tiled loop of :mod:`attncourse.flash` loads and stores, by tensor, and tiles it visits.

    Pass one as ``traffic=`` to :func:`attncourse.flash.flash_attention_forward` (or ``_backward``): the loop
    calls :meth:`read` where it takes a tile of Q, K, V (dO, lse, ...) and :meth:`write` where it stores one, with
    the element count of the tile it really took, summed over the batch and heads of the call.
    """

    reads: dict[str, int] = field(default_factory=dict)
    writes: dict[str, int] = field(default_factory=dict)
    tiles: int = 0
    masked_tiles: int = 0

    def read(self, name: str, elements: int) -> None:
        self.reads[name] = self.reads.get(name, 0) + int(elements)

    def write(self, name: str, elements: int) -> None:
        self.writes[name] = self.writes.get(name, 0) + int(elements)

    def tile(self, masked: bool) -> None:
        self.tiles += 1
        self.masked_tiles += bool(masked)

    @property
    def total_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def total_writes(self) -> int:
        return sum(self.writes.values())

    @property
    def total(self) -> int:
        return self.total_reads + self.total_writes
