"""Progressive consistency distillation: trajectories -> noise-scheduled packing -> AR +
consistency training -> a Jacobi Forcing model (docs/method.md §1-§3)."""
