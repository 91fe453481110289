"""Launchers: local mpiexec (local.py) and a heterogeneous Slurm job through submitit (slurm.py)."""
