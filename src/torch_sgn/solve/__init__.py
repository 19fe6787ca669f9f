"""Solving the damped Gauss-Newton system, and the step around it: the third layer.

* :mod:`.core`: the step core: one SGN step from a linearization (its descent, one per route;
  CG's settings; the geodesic acceleration; the damped step and the probe), the state it hands
  the next step and its report;
* :mod:`.step`: one damped step: the Levenberg-Marquardt attempts of a descent, the trust
  region and the line search, over the typed state of :mod:`.state`; the damping rules and the
  backtracking Armijo line search;
* :mod:`.descents`: what a route and a descent (``damping -> solution``) are: the routes'
  names, a step's phase, the protocol (:mod:`torch_sgn.route_plan` chooses the route);
* :mod:`.cg`: truncated conjugate gradient;
* :mod:`.nystrom`: the randomized Nystrom preconditioner for it;
* :mod:`.direct`: exact solves through ``G`` (``P x P``) or through the batch's outputs;
* :mod:`.sampled`: samples of a residual problem's rows, and the preconditioner they make.
"""
