"""PINNacle's Burgers1D reference (a COMSOL solution on 101 nodes, `ref/burgers1d.dat`) against
the exact solution at the same points, by the Cole-Hopf transform (Basdevant et al. 1986):

    u(x, t) = -int sin(pi (x - s z)) f(x - s z) exp(-z^2) dz / int f(x - s z) exp(-z^2) dz,
    f(y) = exp(-cos(pi y) / (2 pi nu)),  s = sqrt(4 nu t),  nu = 0.01 / pi,

the integrals by the trapezoidal rule on z in [-12, 12] (200,001 nodes). The L2RE of the
reference against it is the floor of PINNacle's metric on this PDE: an exact solution scores it.

    python benchmarks/results/2026-11-29_cpu_pinnacle/burgers_reference.py \
        PINNACLE/ref/burgers1d.dat
"""

import sys

import numpy as np

NU = 0.01 / np.pi
Z = np.linspace(-12, 12, 200001)


def exact(x: np.ndarray, t: float) -> np.ndarray:
    if t == 0:
        return -np.sin(np.pi * x)
    s = np.sqrt(4 * NU * t)
    out = []
    for xi in x:
        y = xi - s * Z
        log_w = -np.cos(np.pi * y) / (2 * np.pi * NU) - Z**2
        w = np.exp(log_w - log_w.max())
        out.append(-np.trapezoid(np.sin(np.pi * y) * w, Z) / np.trapezoid(w, Z))
    return np.array(out)


def main(path: str) -> None:
    data = np.loadtxt(path, comments="%")
    x, ref = data[:, 0], data[:, 1:]
    times = np.linspace(0, 1, ref.shape[1])
    ex = np.stack([exact(x, t) for t in times], 1)
    l2re = np.sqrt(((ref - ex) ** 2).mean()) / np.sqrt((ex**2).mean())
    print(f"points: {ref.size} ({x.size} nodes x {times.size} times)")
    print(f"L2RE of the reference against the exact solution: {l2re:.4e}")
    print(f"largest |reference - exact|: {np.abs(ref - ex).max():.4f}")
    for k, t in enumerate(times):
        e = np.linalg.norm(ref[:, k] - ex[:, k]) / np.linalg.norm(ex[:, k])
        print(f"  t = {t:.1f}: relative error {e:.2e}")


if __name__ == "__main__":
    main(sys.argv[1])
