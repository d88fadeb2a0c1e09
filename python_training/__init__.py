"""Progressive consistency distillation: trajectories -> noise-scheduled packing -> AR +
consistency training -> a Jacobi Forcing model (SPEC §2-§5)."""
