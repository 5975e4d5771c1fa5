r"""A roofline for this machine: measured memory bandwidth, measured matmul throughput, and where a
decode step and a prefill land between them.

    python -m attncourse.roofline            # prints the measurements and the table

The model is the roofline of Williams, Waterman and Patterson (2009): a kernel that does ``F`` FLOPs and
moves ``B`` bytes between memory and the processor has **arithmetic intensity** ``I = F / B`` and can run
no faster than ``min(peak FLOP/s, bandwidth * I)``. The **ridge point** ``peak / bandwidth`` separates
memory-bound kernels (left) from compute-bound ones (right).

A transformer's weights are used once per token in a decode step (a matrix-vector product per weight
matrix: 2 FLOPs per 4-byte float32 weight, ``I`` about 0.5) and ``T`` times in a prefill of ``T`` tokens
(``I`` about ``T / 2`` in float32). :class:`WeightStack` is the part of a model that matters here: a
stack of ``d x d`` weight matrices, large enough (``n_layers * d * d * 4`` bytes) not to fit in the
processor's caches, so that reading the weights really goes to main memory. A *tiny* model's weights fit
in the caches, and there a decode step's time is per-call overhead instead (:func:`call_overhead`).

Timings are best-of-`repeats` wall-clock times; they depend on the machine and its load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import _validate


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, allocator, thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(mib: int = 256, repeats: int = 5, kind: str = "copy") -> float:
    """Memory bandwidth in bytes/s over a float32 buffer of `mib` MiB. ``kind="copy"``: best time to copy it into
    another (STREAM's "copy": every byte read once and written once, so 2 x `mib` MiB move; the write also reads
    the destination into the cache first, which the count does not see). ``kind="read"``: best time of its max,
    a pure read of `mib` MiB, the traffic pattern of a matrix-vector product streaming its weights. Use a buffer
    several times the last-level cache, or the caches answer instead of memory."""
    _validate.positive_int("mib", mib)
    _validate.positive_int("repeats", repeats)
    if kind not in ("copy", "read"):
        raise ValueError(f"kind must be 'copy' or 'read', got {kind!r}")
    src = torch.ones(mib * 2**20 // 4)  # float32
    if kind == "read":
        return src.numel() * 4 / _best_time(lambda: src.amax(), repeats)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / seconds


def measure_peak_flops(n: int = 1024, repeats: int = 3) -> float:
    """Matrix-multiply throughput in FLOP/s: best time of an (n, n) @ (n, n) float32 product, 2 n^3 FLOPs.
    The practical compute roof for this library on this machine (not the processor's datasheet peak)."""
    _validate.positive_int("n", n)
    _validate.positive_int("repeats", repeats)
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    seconds = _best_time(lambda: torch.matmul(a, b, out=out), repeats)
    return 2 * n**3 / seconds


class WeightStack:
    """`n_layers` float32 weight matrices (d, d): the linear layers of a model, as one memory footprint.

    ``forward(x)`` multiplies activations (T, d) by every weight in turn: ``2 T d^2`` FLOPs per layer,
    reading the ``d^2`` weights and the (T, d) activations and writing (T, d).
    """

    def __init__(self, d_model: int = 2048, n_layers: int = 16, seed: int = 0):
        self.d_model = _validate.positive_int("d_model", d_model)
        self.n_layers = _validate.positive_int("n_layers", n_layers)
        gen = torch.Generator().manual_seed(seed)
        scale = d_model**-0.5
        self.weights = [torch.randn(d_model, d_model, generator=gen) * scale for _ in range(n_layers)]

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, d) -> (T, d) through every weight."""
        for w in self.weights:
            x = x @ w  # (T, d) @ (d, d) -> (T, d)
        return x

    def flops(self, tokens: int) -> int:
        return 2 * tokens * self.d_model**2 * self.n_layers

    def bytes_moved(self, tokens: int) -> int:
        """Weights read once, activations read and written once per layer (float32)."""
        return self.weight_bytes + 2 * tokens * self.d_model * 4 * self.n_layers

    def intensity(self, tokens: int) -> float:
        """FLOPs per byte of a forward over `tokens` tokens."""
        return self.flops(tokens) / self.bytes_moved(tokens)


@dataclass
class RooflinePoint:
    tokens: int
    seconds: float  # best wall-clock time of one forward over `tokens` tokens
    flops: int
    bytes_moved: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_moved

    @property
    def achieved(self) -> float:
        """FLOP/s actually reached."""
        return self.flops / self.seconds

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens


def roofline_points(stack: WeightStack, tokens: list[int], repeats: int = 3) -> list[RooflinePoint]:
    """Time one forward of `stack` for each number of tokens (T = 1 is a decode step, larger T a prefill)."""
    _validate.positive_int("repeats", repeats)
    points = []
    for t in tokens:
        _validate.positive_int("tokens", t)
        x = torch.randn(t, stack.d_model)
        seconds = _best_time(lambda: stack.forward(x), repeats)
        points.append(RooflinePoint(t, seconds, stack.flops(t), stack.bytes_moved(t)))
    return points


def attainable(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: min(peak, bandwidth x intensity), in FLOP/s."""
    return min(peak_flops, bandwidth * intensity)


@torch.no_grad()
def call_overhead(model: torch.nn.Module, make_input, repeats: int = 20) -> float:
    """Best seconds of one forward of `model` on ``make_input()`` (a tiny input: what is left is overhead)."""
    x = make_input()
    return _best_time(lambda: model(x), repeats)


def main() -> None:  # pragma: no cover - prints timings
    torch.set_num_threads(1)
    bw, peak = measure_bandwidth(), measure_peak_flops()
    print(f"bandwidth {bw / 1e9:.1f} GB/s, matmul {peak / 1e9:.1f} GFLOP/s, ridge {peak / bw:.1f} FLOP/byte")
    stack = WeightStack()
    print(f"weights: {stack.weight_bytes / 2**20:.0f} MiB")
    print(f"{'tokens':>6} {'FLOP/byte':>9} {'ms':>8} {'GFLOP/s':>8} {'roof':>8} {'ms/token':>9}")
    for p in roofline_points(stack, [1, 2, 4, 8, 16, 32, 64, 128, 256]):
        roof = attainable(p.intensity, peak, bw)
        print(f"{p.tokens:>6} {p.intensity:>9.2f} {p.seconds * 1e3:>8.2f} {p.achieved / 1e9:>8.2f} "
              f"{roof / 1e9:>8.2f} {p.seconds_per_token * 1e3:>9.3f}")


if __name__ == "__main__":  # pragma: no cover
    main()
