"""Prompt sources and reward functions."""
