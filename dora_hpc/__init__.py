"""dora_hpc: multi-version streaming rollout (DORA) for asynchronous RL post-training, Slurm-native."""

__version__ = "0.1.0"


def quiet_hf() -> None:
    """Hugging Face libraries draw no progress bars and log errors only, in this process and the ones it
    starts (ranks read it before they import transformers); a user's own setting stands. Rank 0 names
    the model once instead."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
