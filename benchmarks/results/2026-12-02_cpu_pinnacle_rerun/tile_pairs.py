"""One tile pair's terms of a sample's ``J J^T`` from the layers' factors, as
``torch_sgn.pinn.layer_kernel`` forms them on the CPU (``TILE = 256`` points each side, every
pair of the jets' ``C = 4`` channels, a 100-wide layer: inputs ``in' = 101``, sensitivities
``out = 100``), against the same terms in one product of the channels stacked: CPU seconds of
each (one thread, float64, random factors of these shapes), 20 calls a turn, the two taking
turns, median of 7 turns, and the floating-point rate of the first.

    python benchmarks/results/2026-12-02_cpu_pinnacle_rerun/tile_pairs.py
"""

import statistics
import time

import torch

torch.set_num_threads(1)
torch.manual_seed(0)
C, T, IN, OUT = 4, 256, 101, 100
a_i, a_j = torch.randn(C, T, IN, dtype=torch.float64), torch.randn(C, T, IN, dtype=torch.float64)
d_i, d_j = torch.randn(C, T, OUT, dtype=torch.float64), torch.randn(C, T, OUT, dtype=torch.float64)


def by_pairs(out):
    """The library's way: for each channel pair, two ``T x T`` products and their product."""
    for c in range(C):
        for d in range(C):
            out += (d_i[c] @ d_j[d].T) * (a_i[c] @ a_j[d].T)


def stacked(out):
    """All pairs in one ``C T x C T`` product each, then the sum over the pairs."""
    aa = a_i.reshape(C * T, IN) @ a_j.reshape(C * T, IN).T
    aa.mul_(d_i.reshape(C * T, OUT) @ d_j.reshape(C * T, OUT).T)
    out += aa.view(C, T, C, T).sum((0, 2))


reference = torch.zeros(T, T, dtype=torch.float64)
by_pairs(reference)
check = torch.zeros(T, T, dtype=torch.float64)
stacked(check)
print(f"largest difference: {float((check - reference).abs().max() / reference.abs().max()):.1e}")
times = {f.__name__: [] for f in (by_pairs, stacked)}
for _ in range(7):
    for f in (by_pairs, stacked):
        out = torch.zeros(T, T, dtype=torch.float64)
        start = time.process_time()
        for _ in range(20):
            f(out)
        times[f.__name__].append((time.process_time() - start) / 20)
for name, t in times.items():
    print(f"{name}: {1e3 * statistics.median(t):.2f} ms a tile pair")
flops = C * C * 2 * T * T * (IN + OUT)  # each pair: a T x T x in' and a T x T x out product
rate = flops / statistics.median(times["by_pairs"]) / 1e9
print(f"by_pairs: {flops:.2e} floating-point operations, {rate:.1f} GFLOP/s")
