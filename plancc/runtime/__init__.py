"""What runs inside a job: the device mesh of a layout, parallelizing a model (TP/SP, context
parallelism, activation checkpointing, FSDP2), materializing it, the exact vocab-parallel
log-prob evaluator and training loss, gradient clipping, Hugging Face weights in and out."""
