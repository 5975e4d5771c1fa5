"""What chapter 10's Triton modules share: the optional import, the interpreter switch, and the validation of
the attention signature that chapters 09 and 10 have in common.

**Running on a CPU.** Triton's interpreter runs kernels in NumPy when ``TRITON_INTERPRET=1`` is in the
environment *when a kernel is decorated*, that is when :mod:`attncourse.triton_flash` or
:mod:`attncourse.triton_decode` is first imported; tensors then stay on the CPU. It is slow, but it runs the
same code, so the tests, the lesson and the exercises check the kernels without a GPU. ``import attncourse``
imports none of these modules for that reason: import them explicitly, after setting the variable.

**Without Triton** the modules still import; calling a kernel's launcher raises ``ImportError`` saying what to
install.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass

import torch

from . import _validate
from .flash_io import ALIGNS, check_causal_options  # noqa: F401  (ALIGNS re-exported)

try:  # Triton is optional (Linux wheels only): everything below checks TRITON_AVAILABLE before use.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

TRITON_AVAILABLE = triton is not None
TRITON_VERSION = triton.__version__ if TRITON_AVAILABLE else None
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634  # log2(e): kernels use exp2, so scores are scaled by scale * log2(e)
MAX_HEAD_DIM = 256

__all__ = ["ALIGNS", "TRITON_AVAILABLE", "TRITON_VERSION", "Problem", "block_d", "check_block", "check_inputs",
           "check_scale", "default_blocks", "device", "enable_interpreter", "autotune_search", "interpreted", "prepare",
           "require_triton", "tolerance", "use_autotune"]

if TRITON_AVAILABLE:

    @triton.jit
    def _probe(X):  # never launched: its type says whether kernels are built for the interpreter
        tl.store(X, 0)

    # The tile geometry every attention kernel here shares. A query row i sits at the aligned position
    # p = i + OFFSET (OFFSET = 0 top-left, Tk - Tq bottom-right); causally it sees keys j <= p, and with a
    # window W only p - W < j <= p.

    @triton.jit
    def _allowed(rows, cols, T_Q, T_K, OFFSET, WINDOW, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """True where query `rows` may see key `cols` (index tensors that broadcast against each other)."""
        keep = (rows < T_Q) & (cols < T_K)  # padding past either end never counts
        if IS_CAUSAL:
            pos = rows + OFFSET  # each query's aligned position p
            keep = keep & (cols <= pos)
            if HAS_WINDOW:
                keep = keep & (cols > pos - WINDOW)
        return keep

    @triton.jit
    def _key_range(q_start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """Keys [lo, hi) that rows q_start .. q_start + BLOCK_Q - 1 can see; lo is a multiple of BLOCK_K."""
        lo = 0
        hi = T_K
        if IS_CAUSAL:
            last = tl.minimum(q_start + BLOCK_Q, T_Q) - 1 + OFFSET  # position of the block's last real row
            hi = tl.maximum(tl.minimum(T_K, last + 1), 0)  # keys after it: never loaded
            if HAS_WINDOW:
                first = q_start + OFFSET  # position of the block's first row
                lo = tl.maximum(first - WINDOW + 1, 0) // BLOCK_K * BLOCK_K  # keys before its window: never loaded
        return lo, hi

    @triton.jit
    def _query_range(k_start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                     IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """Query rows [lo, hi) that see some key of k_start .. k_start + BLOCK_K - 1 (the backward's dK/dV loop)."""
        lo = 0
        hi = T_Q
        if IS_CAUSAL:
            lo = tl.maximum(k_start - OFFSET, 0) // BLOCK_Q * BLOCK_Q  # rows placed before the block's first key
            if HAS_WINDOW:
                last = tl.minimum(k_start + BLOCK_K, T_K) - 1
                hi = tl.maximum(tl.minimum(T_Q, last + WINDOW - OFFSET), 0)  # rows whose window passed its last key
        return lo, hi

    @triton.jit
    def _needs_mask(q_start, k_start, T_Q, T_K, OFFSET, WINDOW, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """False when every (row, key) pair of the tile is allowed: such a *full* tile skips the mask."""
        partial = (q_start + BLOCK_Q > T_Q) | (k_start + BLOCK_K > T_K)
        if IS_CAUSAL:
            partial = partial | (k_start + BLOCK_K - 1 > q_start + OFFSET)  # a key after the first row's position
            if HAS_WINDOW:
                partial = partial | (k_start <= q_start + BLOCK_Q - 1 + OFFSET - WINDOW)  # one before the last's window
        return partial


def interpreted() -> bool:
    """True when this module's kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when decorated)."""
    return TRITON_AVAILABLE and type(_probe).__name__ == "InterpretedFunction"


def _language_interpreted() -> bool:
    # Triton's own library functions (tl.zeros, tl.max, ...) are decorated when Triton is first imported.
    return type(tl.zeros).__name__ == "InterpretedFunction"


def enable_interpreter() -> None:
    """Run Triton kernels in the CPU interpreter from now on, even where Triton was imported without it.

    Sets ``TRITON_INTERPRET=1``; if Triton's language module was already imported for a GPU (for example by
    ``torch.utils.flop_counter``), re-imports it, then re-imports the course's Triton modules already loaded so
    their kernels are rebuilt for the interpreter. Call it before creating tensors for the kernels.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    if not TRITON_AVAILABLE:
        return
    if not _language_interpreted():
        import triton.language.standard

        importlib.reload(triton.language.standard)
        importlib.reload(triton.language)
    if not interpreted():  # this module's kernels were built for a GPU: rebuild every loaded kernel module
        for name in ("triton_common", "triton_flash_bwd", "triton_flash", "triton_decode"):
            module = sys.modules.get(f"{__package__}.{name}")
            if module is not None:
                importlib.reload(module)


def device() -> torch.device:
    """Where chapter 10's kernels run, decided in one place: ``cuda`` when a GPU is present and the kernels were not
    built for the interpreter, else ``cpu`` (Triton's interpreter). The lesson, the exercises' launchers and the
    checks build their tensors here."""
    if torch.cuda.is_available() and not (os.environ.get("TRITON_INTERPRET") == "1" or interpreted()):
        return torch.device("cuda")
    return torch.device("cpu")


# How close a kernel's result must be to a float64 (or float32) reference, by where it ran and in which dtype.
# Interpreter: NumPy computes every product in the input dtype with float32 accumulation, so float32 agrees with
# PyTorch to rounding. NVIDIA GPU: ``tl.dot`` on float32 inputs multiplies in TF32 (10-bit mantissa, Triton's
# default ``input_precision="tf32"``, as cuBLAS does with ``allow_tf32``), so float32 results differ by ~1e-3; the
# course keeps TF32 because it is what a float32 ``tl.dot`` does by default on these GPUs and what
# FlashAttention-style kernels are written for (half precision is the fast path; ``input_precision="ieee"``
# would make float32 exact and several times slower). The GPU values cover the largest errors one H100 run met
# (torch 2.11, Triton 3.6, 2026-11-27: float16 3.8e-3, bfloat16 2.1e-2, TF32 gradients 4.0e-3) with headroom.
_TOLERANCES = {
    ("cpu", torch.float32): {"rtol": 1e-5, "atol": 2e-5},
    ("cpu", torch.float16): {"rtol": 2e-3, "atol": 2e-3},
    ("cuda", torch.float32): {"rtol": 1e-2, "atol": 1e-2},
    ("cuda", torch.float16): {"rtol": 5e-3, "atol": 5e-3},
    ("cuda", torch.bfloat16): {"rtol": 3e-2, "atol": 3e-2},
}
_GRAD_FACTOR = {"cpu": 10.0, "cuda": 2.0}  # gradients sum more products: looser on the interpreter's tight default


def tolerance(dtype: torch.dtype = torch.float32, where: torch.device | str | None = None, *,
              grad: bool = False) -> dict[str, float]:
    """``rtol``/``atol`` for ``torch.testing.assert_close`` of a kernel's output (``grad=True``: of its gradients)
    in `dtype` on `where` (default :func:`device`) against a reference in higher precision.

    Raises ``TypeError`` for a dtype the kernels do not run in (bfloat16 has no interpreter: NumPy lacks it)."""
    kind = torch.device(where).type if where is not None else device().type
    kind = "cuda" if kind == "cuda" else "cpu"
    if (kind, dtype) not in _TOLERANCES:
        raise TypeError(f"dtype must be one the kernels run in on {kind} "
                        f"({', '.join(str(d) for k, d in _TOLERANCES if k == kind)}), got {dtype}")
    tol = dict(_TOLERANCES[(kind, dtype)])
    if grad:
        tol = {k: v * _GRAD_FACTOR[kind] for k, v in tol.items()}
    return tol


def autotune_search(search: str | None = None) -> str:
    """Which autotuning search space the kernels are decorated with: ``"full"`` (the default: what the benchmark
    and a learner's GPU use) or ``"quick"`` (one or two configs per kernel, so that a GPU test run compiles a few
    kernels per shape instead of dozens; ``ATTNCOURSE_AUTOTUNE=quick``, set by the test suite's conftest.py).
    Read when a kernel module is imported."""
    search = search if search is not None else os.environ.get("ATTNCOURSE_AUTOTUNE", "full")
    if search not in ("full", "quick"):
        raise ValueError(f"ATTNCOURSE_AUTOTUNE (search) must be 'full' or 'quick', got {search!r}")
    return search


def require_triton() -> None:
    """Raise ImportError, saying what to install, when Triton is missing."""
    if not TRITON_AVAILABLE:
        raise ImportError(
            "attncourse's Triton kernels need Triton, which is not installed: run "
            "`pip install 'attncourse[triton]'` (or `pip install triton`; Linux wheels only). Without a GPU, "
            "also set TRITON_INTERPRET=1 in the environment before importing attncourse.triton_flash.")


def check_block(name: str, value: object) -> int:
    """A block size: a power of two >= 16 (``tl.arange`` needs powers of two, ``tl.dot`` at least 16)."""
    value = _validate.positive_int(name, value)
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.arange and tl.dot need it), got {value}")
    return value


@dataclass
class Problem:
    """A validated attention call, viewed the way the kernels index it.

    ``q`` is (N, H, Tq, D) and ``k``, ``v`` are (N, Hkv, Tk, D), views of the caller's tensors (no copy unless
    the head dim was strided); ``group = H // Hkv`` query heads share a KV head. ``offset`` is the aligned
    position of query row 0 (0 top-left, Tk - Tq bottom-right) and ``window`` is 0 for no window.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    scale: float
    is_causal: bool
    offset: int
    window: int
    block_q: int | None
    block_k: int | None

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def t_q(self) -> int:
        return self.q.shape[2]

    @property
    def t_k(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    # (..., H, T, D) -> (N, H, T, D) as a view when the strides allow; the head dim must have stride 1
    x = x.reshape(1, 1, *x.shape) if x.dim() == 2 else x.reshape(-1, *x.shape[-3:])
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        _validate.tensor(name, x, min_rank=2, floating=True)
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key and value must have the same rank, got {shapes}")
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
        raise ValueError(f"query, key and value must share the head dim (dim -1), got {shapes}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length (dim -2), got {shapes}")
    if query.dim() >= 3:
        if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
            raise ValueError(f"query, key and value must have the same batch dims (before dim -3), got {shapes}")
        if key.shape[-3] != value.shape[-3]:
            raise ValueError(f"key and value must have the same number of heads (dim -3), got {shapes}")
        if key.shape[-3] == 0 or query.shape[-3] % key.shape[-3]:
            raise ValueError(f"the KV heads of key and value (dim -3) must divide the query heads (dim -3), "
                             f"got {shapes}")
    if query.numel() == 0 or key.numel() == 0:
        raise ValueError(f"query, key and value must not be empty, got {shapes}")
    if query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {shapes}")


def _check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                         f"{value.device}")
    if query.device.type == "cpu" and interpreted() and not _language_interpreted():
        raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set (torch.utils.flop_counter, for "
                           "one, imports it), so its own functions are built for a GPU: call "
                           "attncourse.triton_common.enable_interpreter(), or set the variable before any import")
    if query.device.type == "cpu" and not interpreted():
        raise RuntimeError("the tensors are on the CPU but the Triton kernels were built for a GPU: set "
                           "TRITON_INTERPRET=1 in the environment before importing attncourse.triton_flash "
                           "(or attncourse.triton_decode) to run them in the interpreter, or move the tensors "
                           "to a GPU")
    if query.dtype == torch.bfloat16 and interpreted():
        raise TypeError("bfloat16 does not run in Triton's interpreter (NumPy has no bfloat16): use float16 or "
                        "float32 on the CPU, or bfloat16 on a GPU")


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale: 1/sqrt(D) for None, else a float."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Shapes (grouped heads allowed), dtypes and devices, with messages naming the argument and shapes."""
    require_triton()
    _check_shapes(query, key, value)
    _check_tensors(query, key, value)


def prepare(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
            causal_align: str, window: int | None, scale: float | None, block_q: int | None,
            block_k: int | None) -> Problem:
    """Validate the shared signature and return the :class:`Problem` the kernels run on."""
    check_inputs(query, key, value)
    window = check_causal_options(is_causal, causal_align, window)
    block_q = None if block_q is None else check_block("block_q", block_q)
    block_k = None if block_k is None else check_block("block_k", block_k)
    t_q, t_k = query.shape[-2], key.shape[-2]
    offset = t_k - t_q if (is_causal and causal_align == "bottom_right") else 0
    return Problem(_as_4d(query), _as_4d(key), _as_4d(value), tuple(query.shape), tuple(key.shape),
                   check_scale(scale, query.shape[-1]), is_causal, offset, window or 0, block_q, block_k)


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two, at least 16 (``tl.dot``); masks hide the padding."""
    return max(16, 1 << (head_dim - 1).bit_length())


def use_autotune(device: torch.device, block_q: int | None, block_k: int | None) -> bool:
    """Autotune on a GPU when no block size was given; the interpreter runs fixed tiles."""
    return device.type == "cuda" and block_q is None and block_k is None


def default_blocks(device: torch.device) -> tuple[int, int]:
    """Fixed (block_q, block_k) when not autotuning.

    GPU (one block size given): 64 x 64 fits any head dim up to 256 in shared memory. Interpreter: every program
    runs one after another in NumPy, so fewer, bigger tiles are faster; 32 x 32 keeps small tests meaningful.
    """
    return (64, 64) if device.type == "cuda" else (32, 32)

