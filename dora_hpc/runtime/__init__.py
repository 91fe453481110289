"""The imperative shell: MPI roles and the loops of orchestrator, trainer and rollout ranks."""
