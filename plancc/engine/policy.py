"""``plancc.Policy``: the RL policy engine -- one object that owns a parallelized model, its
optimizer and schedule, a frozen reference and the layout, and does what every RL stack writes
by hand around such a model (NeMo-RL's DTensor policy worker, verl's FSDP actor):

- ``train(batch, loss_fn)``: one optimizer step on a global batch with the caller's loss, cut
  into microbatches (rows, a token budget, packing), where the loss is normalized by the valid
  tokens / sequences of the *whole global batch* over every data-parallel rank (``BatchTotals``), so
  the gradient is the one of the unsharded model trained on the whole batch in one pass,
  however the batch is cut;
- ``logprobs`` / ``reference_logprobs``: the policy's and the initial weights' log-probs;
- ``weights()``: the trained weights as ``(hf_name, full tensor)`` one bucket at a time, for an
  inference engine's ``load_weights``;
- ``offload`` / ``onload``, ``save`` / ``load`` (DCP), ``export_hf``.

Every method is collective: every rank of the job calls it alike, each with its own slice of
the global batch (``dp_rank`` says which; the ranks of one tp / cp group pass the same rows,
full length: the engine shards the sequence for cp itself).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ..compiler.plan import Plan, load_plan
from ..layout import Layout
from ..models import load_config
from ..runtime.local_step import optimizer_step
from ..runtime.lora import LoraSpec, adapters_disabled
from ..runtime.mesh import ParallelMesh, default_device_type, init_process_group, seed_data_shard_streams
from . import checkpoint, shards
from .batches import (
    Batch,
    Microbatching,
    balanced_dp_rows,
    dp_slice,
)
from .channel import WeightChannel
from .loss_contract import (  # noqa: F401 - NonFiniteError, check_temperature: public here too
    MIN_TEMPERATURE,
    BatchTotals,
    LossFn,
    NonFiniteError,
    TokenLoss,
    call_loss,
    check_temperature,
)
from .offload import Offloader
from .parallel_model import build_parallel_model
from .param_groups import trained_parameters
from .pipeline.pipeline_steps import build_stages
from .policy_options import (
    OptimizerSpec,
    SchedulerSpec,
    make_optimizer,
    make_scheduler,
    policy_mesh,
)
from .reference import ReferenceWeights, reference_place
from .resume import load_state, save_state
from .steps import ModelParts, PlainSteps, StepExecutor, TrainStep, step_metrics
from .streaming import WeightFormat
from .transport import WeightTransport


class Policy:
    """A parallelized causal LM as an RL policy. Construct it the same way on every rank of a
    torchrun job (the default process group is initialized when it is not yet).

    ``plan``: a plan file or ``Plan``; ``model``: a preset, a Hugging Face folder or a
    ``config.json`` (as ``--model``), or a transformers config (seeded random weights). The
    layout: ``layout=`` a ``plancc.Layout`` or a mesh built by ``plancc.build_mesh`` (None: every
    rank data-parallel).
    ``optimizer``: ``params -> Optimizer`` or ``{"name": "torch.optim.AdamW", "kwargs": {...}}``
    (default AdamW); ``lr_scheduler``: ``optimizer -> scheduler`` or name + kwargs (default
    constant). ``weight_decay``: the matrices' decay, with norms, biases and embeddings excluded
    (``engine.param_groups``; None: the optimizer's own default on every parameter).
    ``param_dtype``: the compute dtype (FSDP2's mixed precision, e.g. ``"bfloat16"``);
    None computes in fp32. Whatever it is, and whatever the model's config says (every real
    checkpoint says bfloat16), the parameters -- the master weights --, their gradients, AdamW's
    state and the checkpoints are fp32 (``models.MASTER_DTYPE``); ``export_hf`` writes the
    config's dtype. ``reference=True`` keeps the initial weights for ``reference_logprobs`` on the
    device in the compute dtype (``"host"``: in host memory; ``engine.reference`` says what each
    costs). ``cpu_offload=True``: FSDP2's CPU offload -- the parameter shards, their gradients
    and so the optimizer's state in host memory, each unit copied to the device for its gather.
    ``lora={"r": 16, "alpha": 32, "targets": [globs], "dropout": 0.0}``: low-rank adapters on
    the targets (``runtime.lora``), laid out with each base layer's style; only they train
    (and hold optimizer state), the base is frozen and is the reference (adapters disabled:
    no second copy); weights go out merged, or as the adapters alone (``adapters_only=True``).
    """

    def __init__(
        self,
        plan: str | Path | Plan,
        model: str | Path | PretrainedConfig,
        *,
        layout: Layout | ParallelMesh | None = None,
        optimizer: OptimizerSpec = None,
        lr_scheduler: SchedulerSpec = None,
        max_grad_norm: float | None = 1.0,
        weight_decay: float | None = None,
        param_dtype: torch.dtype | str | None = None,
        cpu_offload: bool = False,
        reference: bool | str = False,
        lora: LoraSpec | Mapping[str, Any] | None = None,
        seed: int = 0,
        device: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.device = device or default_device_type()
        init_process_group(self.device, timeout_s)
        self._dp_rank: int | None = None
        # the layout converted once, here: a Layout in, the mesh everything below is laid out on
        self.mesh: ParallelMesh = policy_mesh(layout, device=self.device)
        self.plan = plan if isinstance(plan, Plan) else load_plan(str(plan))
        # a config: seeded random weights (``seed``); a name or folder: what ``--model`` loads
        self.source = None if isinstance(model, PretrainedConfig) else str(model)
        self.config = load_config(model)
        dtype = getattr(torch, param_dtype) if isinstance(param_dtype, str) else param_dtype
        # lora= here, else the plan's lora: section
        self.lora = LoraSpec.of(lora) if lora is not None else self.plan.lora
        # the model's parts and the step executor over them: the one place stages are known
        self._steps: StepExecutor
        if self.layout.pp > 1:
            parts, self._steps = build_stages(
                self.plan,
                self.source,
                self.config,
                self.mesh,
                lora=self.lora,
                dtype=dtype,
                seed=seed,
                cpu_offload=cpu_offload,
                device=self.device,
            )
        else:
            model_, source = build_parallel_model(
                self.plan,
                self.source,
                self.config,
                self.mesh,
                device=self.device,
                seed=seed,
                param_dtype=dtype,
                lora=self.lora,
                cpu_offload=cpu_offload,
            )
            parts = ModelParts(model=model_, whole=model_, weight_source=source)
            self._steps = PlainSteps(model_, self.mesh, self.config, self.device, self.plan.loc)
        self.model, self._whole, self.weight_source = parts.model, parts.whole, parts.weight_source
        self._aliases = dict(parts.aliases)
        seed_data_shard_streams(self.mesh, seed)
        # with LoRA only the adapters train: the frozen base gets no gradient and no state
        self.optimizer = make_optimizer(
            optimizer, trained_parameters(self.model, weight_decay, embeddings=parts.copies)
        )
        self.scheduler = make_scheduler(lr_scheduler, self.optimizer)
        self.max_grad_norm = max_grad_norm
        self.step = 0
        # with LoRA the frozen base is the reference (its adapters disabled): nothing to copy
        place = reference_place(reference)
        self._reference = (
            ReferenceWeights(self.model, place=place, dtype=dtype) if place and self.lora is None else None
        )
        # the roles beside training (each its own module): weights out -- the whole model's
        # structure, each tensor from the part that holds it --, memory
        self._transport = WeightTransport(self._whole, self.config, self.device, values=parts.values, held=self.model)
        # the reference's bound method, not a closure over the policy: no cycle keeps a dropped
        # policy's memory until the garbage collector runs
        beside = self._reference.device_tensors if self._reference is not None else tuple
        self._memory = Offloader(self.model, self.optimizer, beside_params=beside, device=self.device)

    # ------------------------------------------------------------------ layout
    @property
    def layout(self) -> Layout:
        return self.mesh.layout

    @property
    def dp_rank(self) -> int:
        """Which slice of a global batch this rank holds: rows ``dp_rank * B/dp_size ...``."""
        if self._dp_rank is None:  # slicing a DeviceMesh costs a millisecond: once per Policy
            self._dp_rank = self.mesh["dp"].get_local_rank()
        return self._dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def whole_model(self) -> nn.Module:
        """The model's structure: ``model`` itself, or under pipeline stages the whole model on
        meta (tied weights tied, as a Hugging Face folder and a checkpoint name them)."""
        return self._whole

    def tied_copies_identical(self) -> bool:
        """Collective: whether every copy of a tied weight (``weight_aliases``) holds the weight's
        values -- the tie kept through training (without stages there are no copies)."""
        return self._steps.tied_copies_identical()

    @property
    def weight_aliases(self) -> dict[str, str]:
        """Names of ``model``'s tensors that a Hugging Face folder holds under another name: a
        tied lm_head's copy on the last pipeline stage (``engine.pipeline.pipeline_ties``); none without."""
        return dict(self._aliases)

    def slice_of(self, global_rows: int) -> slice:
        """This rank's rows of a global batch of ``global_rows`` (which dp must divide)."""
        return dp_slice(global_rows, self.dp_rank, self.dp_size)

    def balanced_slices(self, lengths: list[int] | torch.Tensor) -> list[int]:
        """This rank's rows of a global batch whose rows hold ``lengths`` tokens (the same on every
        rank): ``slice_of``'s count with the token counts as even as possible (the same step,
        normalized globally; the slowest rank less slow: ``engine.batches.balanced_partition``)."""
        return balanced_dp_rows(lengths, self.dp_rank, self.dp_size)

    # ------------------------------------------------------------------ training
    def train(
        self,
        batch: Batch,
        loss_fn: LossFn | None = None,
        *,
        token_loss: TokenLoss | None = None,
        microbatching: Microbatching | None = None,
        entropy: bool = False,
        temperature: float = 1.0,
        **cuts: Any,  # Microbatching's fields as keywords: micro_batch_size=, max_tokens=, pack=
    ) -> dict[str, float]:
        """One optimizer step on this rank's slice of a global batch; metrics reduced over ranks.

        The loss, one of two ways (``engine.loss_contract`` states the contract whole):
        ``loss_fn(logprobs [rows, s], microbatch, norm) -> (loss, metrics)`` per microbatch, any
        function of the log-probs (0 at position 0 and padding; ``microbatch`` every field of the
        batch for its rows, and ``entropy`` with ``entropy=True``); or ``token_loss=fn`` for a sum
        of per-token terms, ``fn(logprobs [n], tokens, norm)`` on flat groups of tokens (every
        field at those tokens, a per-row one at each token's row; weigh terms by ``token_mask``),
        its gradient formed with the lm_head's logits (3 matmuls instead of 4; a ``fn`` that mixes
        tokens is wrong here: it sees a chunk). Either way the loss is this microbatch's share of
        the global batch's: divide by ``norm.tokens`` or ``norm.sequences``, never by what it
        holds. Then the gradients are clipped by their global norm, the optimizer and schedule
        step. ``microbatching``: how the rows are cut (``Microbatching``, or its fields as
        keywords). ``temperature``: the sampler's (a PPO / GRPO ratio against the rollout's
        log-probs is exactly 1 before the first step).

        Returns ``loss`` (of the global batch), ``grad_norm`` (before clipping), ``lr`` (this
        step's), ``tokens`` and ``sequences`` (the global normalizers), ``input_tokens`` (every
        attended token of the global batch, prompts included: what throughput counts),
        ``microbatches`` (per rank), ``seconds``, and the loss's own metrics summed over every dp
        rank's microbatches, by name (a metric some ranks' loss does not give counts 0 there:
        ``agreed_names``).
        """
        self._memory.require_onloaded("train", optimizer=True)
        check_temperature(temperature)
        if (loss_fn is None) == (token_loss is None):
            raise TypeError("Policy.train takes one loss: loss_fn (per microbatch) or token_loss= (per token)")
        if token_loss is not None and entropy:
            raise ValueError("entropy=True hands the entropy to a loss_fn; token_loss terms get log-probs only")
        started = time.perf_counter()
        step = TrainStep(
            batch,
            loss_fn,
            token_loss,
            Microbatching.of(microbatching, cuts),
            entropy=entropy,
            temperature=temperature,
            max_grad_norm=self.max_grad_norm,
        )
        outcome = self._steps.train_step(step, self.optimizer)
        lr = float(self.optimizer.param_groups[0]["lr"])
        optimizer_step(self.optimizer)  # on the local shards where that is the same update
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return step_metrics(outcome, lr, time.perf_counter() - started)

    # ------------------------------------------------------------------ log-probs
    def logprobs(
        self,
        batch: Batch,
        *,
        entropy: bool = False,
        temperature: float = 1.0,
        microbatching: Microbatching | None = None,
        **cuts: Any,  # Microbatching's fields as keywords
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[rows, s]`` fp32 log-probs of this rank's rows under the policy (0 at position 0 and
        padding), at the sampler's ``temperature``; with ``entropy=True`` a pair. Microbatches
        as in ``train`` (rows, a token budget, packed)."""
        self._memory.require_onloaded("logprobs")
        check_temperature(temperature)
        cut = Microbatching.of(microbatching, cuts)
        return self._steps.logprobs(batch, cut, entropy=entropy, temperature=temperature)

    def logits(self, batch: Batch) -> torch.Tensor:
        """fp32 logits of this rank's rows, the vocabulary whole, for comparing with an unsharded
        model (``--verify``): the model's own (a cp rank's positions) without stages, or every
        position on every rank of the pipeline (0 at padding) with them."""
        self._memory.require_onloaded("logits")
        return self._steps.logits(batch)

    def reference_logprobs(self, batch: Batch, **options: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``logprobs`` (the same options) under the frozen initial weights (``reference=True``;
        with LoRA, the base with its adapters disabled); the policy's weights and optimizer state
        are left bitwise as they were."""
        self._memory.require_onloaded("reference_logprobs")  # before the swap, which reads both weights
        if self.lora is not None:
            reference: AbstractContextManager[None] = adapters_disabled(self.model)
        elif self._reference is not None:
            reference = self._reference.swapped_into(self.model)
        else:
            raise ValueError("this Policy keeps no reference: construct it with reference=True")
        with reference:
            return self.logprobs(batch, **options)

    # ------------------------------------------------------------------ weights out
    def weights(self, weight_format: WeightFormat | None = None, **options: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` of every weight as ``export_hf`` writes it (tied weights
        once, transformers' checkpoint names and layouts), gathered one bucket of at most
        ``bucket_bytes`` (or one larger tensor) at a time: the iterable inference engines'
        ``load_weights`` take. Collective: every rank iterates it to the end. With LoRA the
        adapted weights come merged, or with ``adapters_only`` the adapters alone under PEFT's
        names (``base_model.model.<module>.lora_A.weight``). ``weight_format``: a
        ``WeightFormat``, or its fields as keywords (``dtype=torch.bfloat16``)."""
        out = WeightFormat.of(weight_format, options)
        self._memory.require_onloaded("weights")
        shards.back_to_shards(self.model)
        yield from self._transport.stream(out)

    def weights_manifest(self, weight_format: WeightFormat | None = None, **options: Any) -> dict[str, Any]:
        """What ``send_weights`` will send, as JSON-serialisable data for the receiver (every
        tensor's name, shape and dtype, bucket by bucket; with ``adapters_only`` the adapters'
        PEFT config too). Local: nothing is gathered."""
        out = WeightFormat.of(weight_format, options)
        return self._transport.manifest(out)

    def send_weights(
        self,
        channel: WeightChannel | None,
        weight_format: WeightFormat | None = None,
        *,
        reshard: bool = False,
        **options: Any,
    ) -> int:
        """The weights to the receivers of ``channel``, bucket by bucket (``weights_manifest``
        says what they are). Collective over the policy's ranks: every rank gathers, rank 0 --
        the channel's rank 0, the only one that passes a channel -- sends. Returns bytes sent.

        ``reshard=True``: the receivers hold the model at a layout of their own
        (``plancc.receive_weights(..., plan=, tp=)``) and each gets only its shard, straight
        from the policy ranks that hold it; every policy rank passes the channel (it joined as
        its own global rank). Any rank's failure is raised on every rank as one
        ``WeightChannelError`` (``engine.transport``)."""
        out = WeightFormat.of(weight_format, options)
        self._memory.require_onloaded("send_weights")
        shards.back_to_shards(self.model)
        return self._transport.send(channel, out, reshard=reshard)

    def share_weights(
        self, connection: Any, weight_format: WeightFormat | None = None, *, timeout: float = 60.0, **options: Any
    ) -> int:
        """The weights to a consumer process on the same device (a colocated rollout engine),
        bucket by bucket by handle: CUDA IPC on a GPU, shared memory on the CPU, through a
        ``multiprocessing`` connection (``plancc.receive_shared_weights`` on the other end).
        Collective over the policy's ranks; rank 0, the only one that passes a connection,
        shares; the consumer has ``timeout`` seconds to take each bucket. Returns bytes shared."""
        out = WeightFormat.of(weight_format, options)
        self._memory.require_onloaded("share_weights")
        shards.back_to_shards(self.model)
        return self._transport.share(connection, out, timeout=timeout)

    def export_hf(self, folder: str | Path, *, adapters_only: bool = False) -> None:
        """The weights as a ``save_pretrained`` folder (written whole, then moved into place);
        with LoRA merged, or with ``adapters_only`` PEFT's adapter folder."""
        self._memory.require_onloaded("export_hf")
        shards.back_to_shards(self.model)
        source = self.source if self.source is not None and Path(self.source).is_dir() else None
        self._transport.export(folder, source=source, adapters_only=adapters_only)

    # ------------------------------------------------------------------ memory
    def offload(self, *, params: bool = True, optimizer: bool = True) -> None:
        """Parameters (with their gradients, the buffers and a device reference's weights) and /
        or the optimizer's state to pinned host memory while a rollout engine runs on the device,
        the freed memory handed back to the driver (``torch.cuda.empty_cache``) so that another
        process can allocate it; ``onload`` brings everything back (``engine.offload`` says how).
        Nothing moves on CPU."""
        shards.back_to_shards(self.model)
        self._memory.offload(params=params, optimizer=optimizer)

    def onload(self) -> None:
        """Everything ``offload`` moved, back where it was (every tensor object the same)."""
        self._memory.onload()

    # ------------------------------------------------------------------ checkpoints
    def save(
        self, folder: str | Path, *, run: Mapping[str, Any] | None = None, files: Mapping[str, str] | None = None
    ) -> Path:
        """A DCP checkpoint of the model, optimizer and schedule (atomic; loadable at another
        layout). Returns the step folder. ``run``: JSON settings of the caller's run kept beside
        it (``load``'s ``CheckpointInfo.run``), e.g. the total steps a resume must reach;
        ``files``: text files written into the step folder with it (``plancc apply``'s run file)."""
        self._memory.require_onloaded("save", optimizer=True)
        shards.back_to_shards(self.model)
        return save_state(
            folder,
            self.model,
            self.optimizer,
            self.scheduler,
            step=self.step,
            config=self.config,
            plan=self.plan.name,
            layout=self.layout,
            run=run,
            files=files,
            whole=self._whole,
            base=self.weight_source if self.lora is not None else None,
        )

    def load(self, folder: str | Path) -> checkpoint.CheckpointInfo:
        """Continue from ``save``'s newest checkpoint in ``folder`` (any layout): the weights,
        the optimizer's state and the schedule's position come from the checkpoint; the learning
        rate is this policy's configuration (the optimizer's ``lr`` as constructed: a resumed
        run may change it), applied at the restored position of the schedule. Returns what the
        checkpoint says of itself (its step, the layout it was saved at)."""
        self._memory.require_onloaded("load", optimizer=True)
        shards.back_to_shards(self.model)
        info = load_state(
            folder,
            self.model,
            self.optimizer,
            self.scheduler,
            config=self.config,
            plan=self.plan.name,
            whole=self._whole,
            base=self.weight_source if self.lora is not None else None,
            aliases=self.weight_aliases,
        )
        self.step = info.step
        return info

    # ------------------------------------------------------------------ internals
    def _shards(self) -> list[torch.Tensor]:
        """This rank's storage of every parameter, in order (written in place by swaps)."""
        return shards.local_shards(self.model)
