"""The measurement layer: pure functions from a run's log tables (dicts of numpy columns, as
store/shards.py reads them, or as the simulator records them: sim/logs.py) to its figures.

Invariant: nothing here reads a file, a clock or a process; every figure a real and a simulated run share
is defined once, here (docs/glossary.md names each), and ``analyze`` (analysis/), the simulator (sim/),
``plan``'s fit and the trainer's replay call it. Nothing here imports analysis/, sim/, runtime/ or train/.
"""
