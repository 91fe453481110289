"""Run storage: HDF5 shards (trajectories, engine events, training) and checkpoints."""
