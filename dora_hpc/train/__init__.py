"""Trainer side: the GRPO objective (grpo.py, losses.py) over its backends: replicated torch, FSDP2, megatron."""
