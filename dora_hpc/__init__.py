"""dora_hpc: multi-version streaming rollout (DORA) for asynchronous RL post-training, Slurm-native."""

__version__ = "0.1.0"
