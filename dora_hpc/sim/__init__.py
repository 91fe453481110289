"""Discrete-event cluster simulator driving the same core/ policies as the runtime."""
