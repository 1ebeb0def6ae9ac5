"""A training or evaluation job: launching workers with torch's elastic launcher, the worker
itself (data, training loop, DCP checkpoints), verification against the unsharded model and
fault injection for rehearsing failures."""
