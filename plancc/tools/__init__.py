"""Tools around a plan that never start a job: ``explain`` (what every parameter becomes),
``dryrun`` (a fake process group at the real world size) and ``import_hf``."""
