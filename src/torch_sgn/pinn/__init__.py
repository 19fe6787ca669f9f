"""Physics-informed networks and residual least squares."""
