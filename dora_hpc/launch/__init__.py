"""Launchers: local mpiexec (this module's local.py); Slurm comes next."""
