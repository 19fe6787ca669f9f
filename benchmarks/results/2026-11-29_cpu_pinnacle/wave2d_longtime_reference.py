"""PINNacle's Wave2D_LongTime: its analytic reference (``ref_sol`` of ``src/pde/wave.py``, also its
initial and boundary values) put into the PDE its class trains, ``u_tt - (u_xx + a^2 u_yy)``
with ``a = sqrt(2)``, by sympy.

    python benchmarks/results/2026-11-29_cpu_pinnacle/wave2d_longtime_reference.py
"""

import sympy as sp

x, y, t = sp.symbols("x y t")
a = sp.sqrt(2)
# m1=1, m2=3, n1=1, n2=2, p1=1, p2=1 and both coefficients 1: the class's defaults
u = sp.sin(sp.pi * x) * sp.sinh(sp.pi * y) * sp.cos(sp.pi * t) + sp.sinh(3 * sp.pi * x) * sp.sin(
    2 * sp.pi * y
) * sp.cos(sp.pi * t)
wave = sp.diff(u, t, 2) - (sp.diff(u, x, 2) + a**2 * sp.diff(u, y, 2))
print("u_tt - (u_xx + a^2 u_yy) =", sp.factor(sp.simplify(wave)))
print("       as a multiple of u:", sp.simplify(wave / u))
print(
    "u_tt + (u_xx + a^2 u_yy) =",
    sp.simplify(sp.diff(u, t, 2) + sp.diff(u, x, 2) + a**2 * sp.diff(u, y, 2)),
)
largest = sp.sinh(3 * sp.pi).evalf()
print(f"largest |u| on [0, 1]^2 x [0, 100]: about sinh(3 pi) = {float(largest):.0f}")
