"""``plancc.ray``: a ``plancc.Policy`` as a group of Ray actors (``pip install 'plancc[ray]'``).

``PolicyGroup(num_workers, plan, model, **policy_kwargs)`` starts one actor per rank, sets up
the process group among them and fans ``train``, ``logprobs``, ``reference_logprobs``,
``offload``, ``onload``, ``save``, ``weights_manifest`` and ``send_weights`` out over them.
"""

from .engine.ray_group import PolicyGroup, PolicyGroupError, PolicyWorker

__all__ = ["PolicyGroup", "PolicyGroupError", "PolicyWorker"]
