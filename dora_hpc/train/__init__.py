"""Trainer side: the GRPO/PPO objective and its backends (torch now; FSDP2 and megatron-core later)."""
