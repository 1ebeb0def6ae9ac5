"""The RL policy engine: ``Policy`` owns a parallelized model, its optimizer and schedule, a
frozen reference and the layout, and cuts batches into microbatches for training and log-probs
alike; weights leave it by bucket. Below the job layer (the ``apply`` runner) and above the
runtime; DCP checkpoints of its state live here too."""
