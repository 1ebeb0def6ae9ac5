"""Pipeline parallelism: the model cut into stages and stepped by torch's schedules.

One subsystem, read top down:

- ``pipeline_steps``: ``build_stages`` (this rank's stages cut, parallelized and filled) and
  ``PipelineSteps``, the step executor ``Policy`` runs a step through when ``pp > 1`` -- the one
  place the engine knows about stages (``engine.steps`` is the plain executor beside it).
- ``pipeline_rows``: a step's rows as the schedule's microbatches (uneven rows unpadded, or
  packed rows with their positions).
- ``pipeline_last_stage``: the loss, log-probs and logits the last stage computes, and their
  way back to every rank.
- ``pipeline_stages``: the stage runtime -- ``DecoderStage`` (a slice of the decoder),
  ``parallelize_stages`` (tp / cp / FSDP / LoRA inside a stage), ``PipelineRunner`` (torch's
  schedule over the rank's stages).
- ``pipeline_ties``: weights tied across stages (an embedding and its head) kept equal.
- ``stage_values``: whole tensors of a staged model, for the weights that go out.

What the plan and the checks read before torch is loaded lives below the engine: the schedules'
names and stage shapes (``plancc.schedules``), which layers a stage holds by the plan's globs
(``compiler.stage_globs``), the check of a ``pipeline:`` section (``checks.pipeline``), and
``plancc explain``'s table of stages (``tools.explain_stages``).
"""
