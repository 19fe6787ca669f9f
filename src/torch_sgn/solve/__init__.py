"""Solving the damped Gauss-Newton system, and the step around it: the third layer.

* :mod:`.core`: the step core: one SGN step from a linearization (its descent, damped step
  and probe, CG's settings), the state it hands the next step and its report;
* :mod:`.step`: one damped step: the Levenberg-Marquardt attempts of a descent, the trust
  region and the line search, over the typed state of :mod:`.state`; the damping rules and the
  backtracking Armijo line search;
* :mod:`.descents`: the descents, ``damping -> solution`` by CG, through ``G``, or through the
  batch's outputs (:mod:`torch_sgn.route_plan` chooses one);
* :mod:`.cg`: truncated conjugate gradient;
* :mod:`.nystrom`: the randomized Nystrom preconditioner for it;
* :mod:`.direct`: exact solves through ``G`` (``P x P``) or through the batch's outputs;
* :mod:`.geodesic`: geodesic acceleration;
* :mod:`.sampled`: samples of a residual problem's rows, and the preconditioner they make.
"""
