"""Solving the damped Gauss-Newton system, and the step around it: the third layer.

* :mod:`.cg`: truncated conjugate gradient;
* :mod:`.nystrom`: the randomized Nystrom preconditioner for it;
* :mod:`.direct`: exact solves through ``G`` (``P x P``) or through the batch's outputs;
* :mod:`.damping`: the Levenberg-Marquardt damping rules;
* :mod:`.line_search`: the backtracking Armijo line search;
* :mod:`.geodesic`: geodesic acceleration;
* :mod:`.auto`: when ``solver="auto"`` switches from CG to exact steps.
"""
