"""plancc's side inside a vLLM environment: a weight-transfer backend and the rollout server.

vLLM pins another transformers than plancc, so it runs in its own environment (as in
production: a rollout fleet beside the trainers) and this package imports nothing of
``plancc``. Installed there with plancc itself (``scripts/vllm_env.sh``: ``pip install
--no-deps``), it registers through vLLM's plugin entry point (``vllm.general_plugins``, loaded
in every vLLM process, the workers included) the weight-transfer backend ``plancc_gloo``
(``plancc_vllm.engine``): vLLM's four-phase protocol over a gloo group with the trainer, each
worker receiving only the slice of every weight that its tensor-parallel rank loads.
"""

from __future__ import annotations

BACKEND = "plancc_gloo"


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: runs once per vLLM process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "plancc_vllm.engine", "ShardEngine")
    except ValueError:  # registered already in this process
        pass
