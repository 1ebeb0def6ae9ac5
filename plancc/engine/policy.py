"""``plancc.Policy``: the RL policy engine -- one object that owns a parallelized model, its
optimizer and schedule, a frozen reference and the layout, and does what every RL stack writes
by hand around such a model (NeMo-RL's DTensor policy worker, verl's FSDP actor):

- ``train(batch, loss_fn)``: one optimizer step on a global batch with the caller's loss, cut
  into microbatches (rows, a token budget, packing), where the loss is normalized by the valid
  tokens / sequences of the *whole global batch* over every data-parallel rank (``Norm``), so
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

import math
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from ..compiler.plan import Plan, load_plan
from ..layout import Layout
from ..models import load_config
from ..runtime.fused_logprobs import targets_checked
from ..runtime.gradient_scale import loss_scale, token_loss_scale
from ..runtime.gradnorm import clip_grad_norm_
from ..runtime.logprobs import fusable, token_logprobs
from ..runtime.lora import LoraSpec, adapters_disabled
from ..runtime.mesh import ParallelMesh, default_device_type, init_process_group, seed_data_shard_streams
from ..runtime.non_finite import first_non_finite
from ..runtime.stepping import require_stepped
from ..runtime.token_loss import evaluated_positions, model_token_loss
from . import checkpoint, shards
from .agreement import first_problem
from .batches import (
    Batch,
    BatchError,
    Microbatch,
    balanced_dp_rows,
    check_batch,
    default_token_mask,
    dp_slice,
    plan_microbatches,
    row_spans,
    spread_to,
)
from .build import build_parallel_model
from .channel import WeightChannel
from .export import export_hf
from .loss_contract import (  # noqa: F401 - Norm, NonFiniteError, check_temperature: public here too
    MIN_TEMPERATURE,
    LossFn,
    NonFiniteError,
    Norm,
    TokenLoss,
    call_loss,
    check_temperature,
)
from .offload import Offloader
from .options import OptimizerSpec, SchedulerSpec, make_optimizer, make_scheduler, the_layout, the_mesh
from .pipelined import PipelinePolicy
from .reference import ReferenceWeights, reference_place
from .resume import load_state, save_state
from .streaming import DEFAULT_BUCKET_BYTES
from .transport import WeightTransport

FINGERPRINT_MODULUS = 2**52  # a batch fingerprint below it is exact in the float64 verdicts gathered


class Policy:
    """A parallelized causal LM as an RL policy. Construct it the same way on every rank of a
    torchrun job (the default process group is initialized when it is not yet).

    ``plan``: a plan file or ``Plan``; ``model``: a preset, a Hugging Face folder or a
    ``config.json`` (as ``--model``), or a transformers config (seeded random weights). The
    layout, one way: ``layout=`` a ``plancc.Layout`` or a mesh built by ``plancc.build_mesh``
    (``mesh=`` is the older name), or the ``tp``, ``cp``, ``ep``, ``dp`` (inferred), ``sp``
    shorthand; shorthand that disagrees with a given layout is a ``LayoutError``.
    ``optimizer``: ``params -> Optimizer`` or ``{"name": "torch.optim.AdamW", "kwargs": {...}}``
    (default AdamW); ``lr_scheduler``: ``optimizer -> scheduler`` or name + kwargs (default
    constant). ``param_dtype``: the compute dtype (FSDP2's mixed precision, e.g. ``"bfloat16"``);
    None computes in fp32. Whatever it is, and whatever the model's config says (every real
    checkpoint says bfloat16), the parameters -- the master weights --, their gradients, AdamW's
    state and the checkpoints are fp32 (``models.MASTER_DTYPE``); ``export_hf`` writes the
    config's dtype. ``reference=True`` keeps the initial weights for ``reference_logprobs`` on the
    device in the compute dtype (``"host"``: in host memory; ``engine.reference`` says what each
    costs).
    ``lora={"r": 16, "alpha": 32, "targets": [globs], "dropout": 0.0}``: low-rank adapters on
    the targets (``runtime.lora``), laid out with each base layer's style; only they train
    (and hold optimizer state), the base is frozen and is the reference (adapters disabled:
    no second copy); weights go out merged, or as the adapters alone (``adapters_only=True``).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # a layout with pipeline stages: the same calls over a rank's stages (engine.pipelined)
        layout, pp = kwargs.get("layout"), kwargs.pop("pp", 1)
        if cls is Policy and pp > 1 and layout is None:  # the shorthand: Policy(..., pp=2, tp=2)
            init_process_group(kwargs.get("device") or default_device_type(), kwargs.get("timeout_s", 600.0))
            sizes = {k: kwargs.pop(k) for k in ("dp", "cp", "tp", "ep") if k in kwargs}
            sp = kwargs.pop("sp", False)
            layout = kwargs["layout"] = Layout.infer(
                world_size=dist.get_world_size(), pp=pp, sequence_parallel=sp, **sizes
            )
        if cls is Policy and isinstance(layout, Layout | ParallelMesh) and the_layout(layout).pp > 1:
            return PipelinePolicy(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        plan: str | Path | Plan,
        model: str | Path | PretrainedConfig,
        *,
        # the layout, one way: a Layout or a built mesh; or the sizes as shorthand
        layout: Layout | ParallelMesh | None = None,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        dp: int | None = None,
        sp: bool = False,
        mesh: ParallelMesh | None = None,  # the same as layout=<a built mesh> (its earlier name)
        # the optimization
        optimizer: OptimizerSpec = None,
        lr_scheduler: SchedulerSpec = None,
        max_grad_norm: float | None = 1.0,
        # the model's numbers and where they live
        param_dtype: torch.dtype | str | None = None,
        reference: bool | str = False,
        lora: LoraSpec | Mapping[str, Any] | None = None,
        seed: int = 0,
        device: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.device = device or default_device_type()
        init_process_group(self.device, timeout_s)
        self._dp_rank: int | None = None
        self.mesh: ParallelMesh = the_mesh(
            layout, mesh, {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "sp": sp}, device=self.device
        )
        self.plan = plan if isinstance(plan, Plan) else load_plan(str(plan))
        # a config: seeded random weights (``seed``); a name or folder: what ``--model`` loads
        self.source = None if isinstance(model, PretrainedConfig) else str(model)
        self.config = load_config(model)
        dtype = getattr(torch, param_dtype) if isinstance(param_dtype, str) else param_dtype
        # lora= here, else the plan's lora: section
        self.lora = LoraSpec.of(lora) if lora is not None else self.plan.lora
        self.model, self.weight_source = build_parallel_model(
            self.plan,
            self.source,
            self.config,
            self.mesh,
            device=self.device,
            seed=seed,
            param_dtype=dtype,
            lora=self.lora,
        )
        seed_data_shard_streams(self.mesh, seed)
        # with LoRA only the adapters train: the frozen base gets no gradient and no state
        self.optimizer = make_optimizer(optimizer, [p for p in self.model.parameters() if p.requires_grad])
        self.scheduler = make_scheduler(lr_scheduler, self.optimizer)
        self.max_grad_norm = max_grad_norm
        self.step = 0
        # with LoRA the frozen base is the reference: nothing to copy
        place = reference_place(reference)
        self._reference = (
            ReferenceWeights(self._shards(), place=place, dtype=dtype) if place and self.lora is None else None
        )
        # the roles beside training (each its own module): weights out, memory
        self._transport = WeightTransport(self.model, self.config, self.device)
        self._memory = Offloader(self.model, self.optimizer)

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

    def slice_of(self, global_rows: int) -> slice:
        """This rank's rows of a global batch of ``global_rows`` (which dp must divide)."""
        return dp_slice(global_rows, self.dp_rank, self.dp_size)

    def balanced_slices(self, lengths: list[int] | torch.Tensor) -> list[int]:
        """This rank's rows of a global batch whose rows hold ``lengths`` tokens (``attention_mask
        .sum(1)``, the same on every rank): as many rows on every dp rank as ``slice_of`` gives,
        with the token counts as even as possible (``engine.batches.balanced_partition``).
        The step is the same as with ``slice_of`` (the loss is normalized globally); the
        slowest rank is less slow."""
        return balanced_dp_rows(lengths, self.dp_rank, self.dp_size)

    # ------------------------------------------------------------------ training
    def train(
        self,
        batch: Batch,
        loss_fn: LossFn | None = None,
        *,
        token_loss: TokenLoss | None = None,
        micro_batch_size: int | None = None,
        max_tokens: int | None = None,
        pack: bool = False,
        entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step on this rank's slice of a global batch; metrics reduced over ranks.

        The loss, one of two ways:

        - ``loss_fn(logprobs, microbatch, norm) -> (loss, metrics)`` for each microbatch, where
          ``logprobs [rows, s]`` fp32 are log p(input_ids[t] | input_ids[<t]) (0 at position 0
          and padding), ``microbatch`` holds every field of the batch for its rows (and
          ``entropy`` with ``entropy=True``) and ``norm`` the global batch's ``Norm``. Any
          function of the log-probs (a sequence-level ratio, a mean over a row).
        - ``token_loss=fn``, for a loss that is a *sum of per-token terms*, each a function of
          its own token's log-prob and constants (NLL, a clipped PPO / GRPO surrogate, a per-token
          KL): ``fn(logprobs, tokens, norm) -> loss`` or ``(loss, metrics)``, called on flat
          ``[n]`` groups of tokens, ``tokens`` holding every field at those tokens (a per-row
          field such as ``advantages [rows]`` at each token's row). Positions the sequence gives
          no log-prob (position 0, padding) are either left out or come with log-prob 0 and every
          field 0, so weigh each term by a mask (``token_mask``) as a ``loss_fn`` would. The
          gradient is formed while the lm_head's logits are computed: 3 matmuls for the vocabulary
          projection instead of 4, and it equals ``loss_fn``'s for the same sum (a model whose
          logits are more than ``lm_head(hidden)`` takes the log-probs path: same numbers). A
          ``fn`` that mixes tokens (a mean over what it is given) is wrong here: it sees a chunk.
          Metrics are summed over the groups.

        Either way the loss is this microbatch's share of the global batch's loss (divide by
        ``norm.tokens`` or ``norm.sequences``, never by what it holds). Then the gradients are
        clipped by their global norm, the optimizer and schedule step.

        ``temperature``: the sampler's; the log-probs are those of the logits divided by it, as
        ``logprobs(temperature=)`` gives them, so a PPO / GRPO ratio against the rollout's
        log-probs is exactly 1 before the first step (verl and NeMo-RL divide likewise).

        Returns ``loss`` (of the global batch), ``grad_norm`` (before clipping), ``lr`` (the one
        this step used), ``tokens`` and ``sequences`` (the global normalizers), ``microbatches``
        (per rank), ``seconds``, and each of the loss's own metrics summed over the microbatches
        of every dp rank, by name: a metric some ranks' loss does not give (``if clipped.any():
        m["clip_frac"] = ...``) counts 0 on those (``agreed_names``).
        """
        self._require_onloaded("train")
        check_temperature(temperature)
        if (loss_fn is None) == (token_loss is None):
            raise TypeError("Policy.train takes one loss: loss_fn (per microbatch) or token_loss= (per token)")
        if token_loss is not None and entropy:
            raise ValueError("entropy=True hands the entropy to a loss_fn; token_loss terms get log-probs only")
        started = time.perf_counter()
        batch, norm, plan = self._prepared(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        if not self.model.training:  # every module's flag: a walk of the model, not free on each step
            self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, torch.Tensor | float] = {}
        # Nothing reads the device inside the loop (a GPU's queue never stalls on the host): a
        # microbatch whose loss the caller's function refused is noted and agreed on after the
        # last backward, whether each loss is finite is read once at the end, metrics are summed
        # where they are.
        refused = ""  # this rank's first refused microbatch
        finite: list[torch.Tensor] = []
        spans = row_spans(batch["attention_mask"])  # every row's, read once for the cuts and packing
        try:
            for index, rows in enumerate(plan):
                mb = Microbatch.of(batch, rows, multiple=self.layout.sequence_multiple, pack=pack, spans=spans)
                if token_loss is not None:
                    loss, metrics, problem = self._token_pass(mb, token_loss, norm, index, temperature)
                else:
                    assert loss_fn is not None, "one loss is given (checked above)"
                    loss, metrics, problem = self._loss_pass(mb, loss_fn, norm, index, entropy, temperature)
                refused = refused or problem
                finite.append(torch.isfinite(loss))
                loss_sum += loss.to(torch.float64)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
            grad_norm = float(clip_grad_norm_(self.model.parameters(), self.max_grad_norm or math.inf))
            # the shares are the dp ranks' (a token loss's: dp x cp, each cp rank its positions)
            shares = self.dp_size * (self.layout.cp if token_loss is not None else 1)
            not_finite, loss_total, metric_sums = self._settle(refused, finite, loss_sum, sums, shares)
            if not_finite or not math.isfinite(grad_norm):
                self._raise_non_finite(finite, loss_total, grad_norm)
            require_stepped(self.model, self.optimizer, where=self.plan.loc)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # nothing of this step is kept
            shards.reshard(self.model)
            raise
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "loss": loss_total,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": norm.tokens,
            "sequences": norm.sequences,
            "microbatches": float(len(plan)),
            "seconds": time.perf_counter() - started,
            **metric_sums,
        }

    def _loss_pass(
        self, mb: Microbatch, loss_fn: LossFn, norm: Norm, index: int, entropy: bool, temperature: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float], str]:
        """One microbatch's forward and backward with a ``loss_fn``: (its loss, its metrics, the
        refusal of its loss or "")."""
        lp, ent = self._forward(mb, entropy=entropy, temperature=temperature)
        fields = dict(mb.fields)
        if ent is not None:
            fields["entropy"] = ent
        problem = ""
        try:
            loss, metrics = call_loss(loss_fn, lp, fields, norm, index)
        except BatchError as exc:  # the step is refused after the loop, on every rank
            problem = str(exc)
            loss, metrics = (lp * 0).sum(), {}  # the passes every rank runs; its gradient is dropped
        # the global loss's gradient (runtime.gradient_scale states the invariant)
        (loss * loss_scale(self.layout)).backward()  # even when not finite: every rank runs the same passes
        return loss.detach(), metrics, problem

    def _token_pass(
        self, mb: Microbatch, token_loss: TokenLoss, norm: Norm, index: int, temperature: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float], str]:
        """One microbatch's forward and backward with a ``token_loss``: the 3-matmul path
        (``runtime.token_loss``), or the log-probs path for a model that transforms its logits."""
        evaluated = evaluated_positions(
            self.model, mb.batch_positions(), attention_mask=mb.attention_mask, cu_seqlens=mb.cu_seqlens
        )
        terms = _TokenTerms(token_loss, mb.per_token(evaluated), norm, index)
        if fusable(self.model):
            with targets_checked():  # check_batch read them, once per step
                loss = model_token_loss(
                    self.model,
                    mb.input_ids,
                    evaluated,
                    terms,
                    attention_mask=mb.attention_mask,
                    cu_seqlens=mb.cu_seqlens,
                    temperature=temperature,
                    document_bounds=mb.starts,
                )
        else:
            lp, _ = self._forward(mb, entropy=False, temperature=temperature)
            known = evaluated >= 0
            mine = torch.where(known, lp.reshape(-1)[evaluated.clamp(min=0)], torch.zeros_like(known, dtype=lp.dtype))
            loss = terms(mine, slice(0, mine.numel()))
        # each cp rank's loss is its positions' share: runtime.gradient_scale.token_loss_scale
        (loss * token_loss_scale(self.layout)).backward()
        return loss.detach(), terms.metrics, terms.problem

    # ------------------------------------------------------------------ log-probs
    def logprobs(
        self,
        batch: Batch,
        *,
        entropy: bool = False,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        max_tokens: int | None = None,
        pack: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[rows, s]`` fp32 log-probs of this rank's rows under the policy (0 at position 0 and
        padding), at the sampler's ``temperature``; with ``entropy=True`` a pair. Microbatches
        as in ``train`` (rows, a token budget, packed)."""
        self._require_onloaded("logprobs")
        check_temperature(temperature)
        batch, _, plan = self._prepared(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        rows_total, seq = batch["input_ids"].shape
        out = torch.zeros((rows_total, seq), dtype=torch.float32, device=self.device)
        ent_out = torch.zeros_like(out) if entropy else None
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                spans = row_spans(batch["attention_mask"])
                for rows in plan:
                    mb = Microbatch.of(batch, rows, multiple=self.layout.sequence_multiple, pack=pack, spans=spans)
                    lp, ent = self._forward(mb, entropy=entropy, temperature=temperature)
                    out[rows] = lp
                    if ent_out is not None and ent is not None:
                        ent_out[rows] = ent
        finally:
            self.model.train(was_training)
        return (out, ent_out) if ent_out is not None else out

    def reference_logprobs(
        self,
        batch: Batch,
        *,
        entropy: bool = False,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        max_tokens: int | None = None,
        pack: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``logprobs`` under the frozen initial weights (``reference=True``; with LoRA, the
        base with its adapters disabled); the policy's weights and optimizer state are left
        bitwise as they were."""
        if self.lora is not None:
            reference: AbstractContextManager[None] = adapters_disabled(self.model)
        elif self._reference is not None:
            reference = self._reference.swapped_into(self._shards)
        else:
            raise ValueError("this Policy keeps no reference: construct it with reference=True")
        with reference:
            return self.logprobs(
                batch,
                entropy=entropy,
                temperature=temperature,
                micro_batch_size=micro_batch_size,
                max_tokens=max_tokens,
                pack=pack,
            )

    # ------------------------------------------------------------------ weights out
    def weights(
        self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None, adapters_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` of every weight as ``export_hf`` writes it (tied weights
        once, transformers' checkpoint names and layouts), gathered one bucket of at most
        ``bucket_bytes`` (or one larger tensor) at a time: the iterable inference engines'
        ``load_weights`` take. Collective: every rank iterates it to the end. With LoRA the
        adapted weights come merged, or with ``adapters_only`` the adapters alone under PEFT's
        names (``base_model.model.<module>.lora_A.weight``)."""
        self._require_onloaded("weights")
        shards.reshard(self.model)
        yield from self._transport.stream(bucket_bytes=bucket_bytes, dtype=dtype, adapters_only=adapters_only)

    def weights_manifest(
        self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None, adapters_only: bool = False
    ) -> dict[str, Any]:
        """What ``send_weights`` will send, as JSON-serialisable data for the receiver (every
        tensor's name, shape and dtype, bucket by bucket; with ``adapters_only`` the adapters'
        PEFT config too). Local: nothing is gathered."""
        return self._transport.manifest(bucket_bytes=bucket_bytes, dtype=dtype, adapters_only=adapters_only)

    def send_weights(
        self,
        channel: WeightChannel | None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        reshard: bool = False,
        adapters_only: bool = False,
    ) -> int:
        """The weights to the receivers of ``channel``, bucket by bucket (``weights_manifest``
        says what they are). Collective over the policy's ranks: every rank gathers, rank 0 --
        the channel's rank 0, the only one that passes a channel -- sends. Returns bytes sent.

        ``reshard=True``: the receivers hold the model at a layout of their own
        (``plancc.receive_weights(..., plan=, tp=)``) and each gets only its shard, straight
        from the policy ranks that hold it; every policy rank passes the channel (it joined as
        its own global rank). Any rank's failure is raised on every rank as one
        ``WeightChannelError`` (``engine.transport``)."""
        self._require_onloaded("send_weights")
        shards.reshard(self.model)
        return self._transport.send(
            channel, bucket_bytes=bucket_bytes, dtype=dtype, reshard=reshard, adapters_only=adapters_only
        )

    def share_weights(
        self,
        connection: Any,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        timeout: float = 60.0,
        adapters_only: bool = False,
    ) -> int:
        """The weights to a consumer process on the same device (a colocated rollout engine),
        bucket by bucket by handle: CUDA IPC on a GPU, shared memory on the CPU, through a
        ``multiprocessing`` connection (``plancc.receive_shared_weights`` on the other end).
        Collective over the policy's ranks; rank 0, the only one that passes a connection,
        shares; the consumer has ``timeout`` seconds to take each bucket. Returns bytes shared."""
        self._require_onloaded("share_weights")
        shards.reshard(self.model)
        return self._transport.share(
            connection, bucket_bytes=bucket_bytes, dtype=dtype, timeout=timeout, adapters_only=adapters_only
        )

    def export_hf(self, folder: str | Path, *, adapters_only: bool = False) -> None:
        """The weights as a ``save_pretrained`` folder (written whole, then moved into place);
        with LoRA merged, or with ``adapters_only`` PEFT's adapter folder."""
        self._require_onloaded("export_hf")
        shards.reshard(self.model)
        source = self.source if self.source is not None and Path(self.source).is_dir() else None
        export_hf(self.model, self.config, folder, source=source, adapters_only=adapters_only)

    # ------------------------------------------------------------------ memory
    def offload(self, *, params: bool = True, optimizer: bool = True) -> None:
        """Parameters (with their gradients and the buffers) and / or the optimizer's state to
        pinned host memory while a rollout engine runs on the device, the freed memory handed
        back to the driver (``torch.cuda.empty_cache``) so that another process can allocate it;
        ``onload`` brings everything back (``engine.offload`` says how). Nothing moves on CPU."""
        shards.reshard(self.model)
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
        self._require_onloaded("save")
        shards.reshard(self.model)
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
        )

    def load(self, folder: str | Path) -> checkpoint.CheckpointInfo:
        """Continue from ``save``'s newest checkpoint in ``folder`` (any layout): the weights,
        the optimizer's state and the schedule's position come from the checkpoint; the learning
        rate is this policy's configuration (the optimizer's ``lr`` as constructed: a resumed
        run may change it), applied at the restored position of the schedule. Returns what the
        checkpoint says of itself (its step, the layout it was saved at)."""
        self._require_onloaded("load")
        shards.reshard(self.model)
        info = load_state(folder, self.model, self.optimizer, self.scheduler, config=self.config, plan=self.plan.name)
        self.step = info.step
        return info

    # ------------------------------------------------------------------ internals
    def _require_onloaded(self, what: str) -> None:
        if self._memory.offloaded:
            offloaded = " and ".join(self._memory.offloaded)
            raise RuntimeError(f"Policy.{what}: the policy's {offloaded} are offloaded; call onload() first")

    def _prepared(
        self, batch: Batch, *, micro_batch_size: int | None, max_tokens: int | None
    ) -> tuple[dict[str, torch.Tensor], Norm, list[list[int]]]:
        """(the batch on this device, the global batch's ``Norm``, this rank's microbatches) once
        every rank has found its own slice usable, the dp ranks hold as many rows (a global batch
        split evenly: ``slice_of``) and the ranks of one tp / cp group the same ones (a
        fingerprint of the rows compared); the same ``BatchError`` on every rank otherwise,
        naming the rank or the ranks. Every rank plans as many microbatches as the dp rank with
        the most (collectives line up). One all-gather over every rank for all of it: each rank
        sees every rank's verdict and counts, so each raises, or goes on, alike."""
        vocab = getattr(self.config.get_text_config(), "vocab_size", None)
        problem = ""
        try:
            check_batch(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens, vocab_size=vocab)
        except BatchError as exc:
            problem = str(exc)
        on_device: dict[str, torch.Tensor] = {}
        plan: list[list[int]] = []
        mine = torch.zeros(8, dtype=torch.float64, device=self.device)
        if problem:
            mine[0] = 1
        else:
            on_device = {name: value.to(self.device) for name, value in batch.items()}
            ids, mask = on_device["input_ids"], on_device["attention_mask"]
            plan = plan_microbatches(mask.sum(1).tolist(), micro_batch_size=micro_batch_size, max_tokens=max_tokens)
            token_mask, sample_mask = on_device.get("token_mask"), on_device.get("sample_mask")
            weights = torch.arange(1, ids.numel() + 1, device=self.device).reshape(ids.shape)
            # the same rows give the same numbers: int64 sums (wrapping is fine for a
            # fingerprint), kept below 2^52 so that float64 holds them exactly, each converted
            # on its own -- stacked with a float mask's sum they would be promoted to float32
            # and the "different rows" check below would stop seeing differences
            counts = [
                torch.tensor(ids.shape[0], device=self.device),
                (ids.long() * weights).sum() % FINGERPRINT_MODULUS,
                (mask.long() * weights).sum() % FINGERPRINT_MODULUS,
                torch.tensor(ids.shape[1], device=self.device),
                (token_mask if token_mask is not None else default_token_mask(mask)).sum(),
                sample_mask.sum() if sample_mask is not None else torch.tensor(ids.shape[0], device=self.device),
                torch.tensor(len(plan), device=self.device),
            ]
            mine[1:] = torch.stack([count.to(torch.float64) for count in counts])
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        verdicts = torch.stack(every).tolist()
        if any(v[0] for v in verdicts):  # a rank's own slice is unusable: its words, gathered now
            self._agree(partial(_raise_if, problem))
        assert (self.mesh.device_mesh.mesh_dim_names or ("",))[0] == "dp", "the (dp, cp, tp) mesh: dp first"
        ranks = self.mesh.device_mesh.mesh.reshape(self.dp_size, -1).tolist()  # each dp rank's replicas
        sizes = [int(verdicts[group[0]][1]) for group in ranks]
        if len(set(sizes)) > 1:
            raise BatchError(
                f"the dp ranks hold {sizes} rows: a global batch splits into equal slices over dp={self.dp_size} "
                "(pass rows policy.slice_of(global_rows) on each rank)"
            )
        for group in ranks:
            if any(verdicts[r][1:5] != verdicts[group[0]][1:5] for r in group):
                raise BatchError(
                    f"the ranks {group} of one tp / cp group were given different rows: they must pass the same "
                    "rows, full length (the engine shards the sequence for cp itself)"
                )
        shares = [verdicts[group[0]] for group in ranks]  # one per dp rank
        norm = Norm(tokens=sum(v[5] for v in shares), sequences=sum(v[6] for v in shares))
        spread = spread_to(plan, int(max(v[7] for v in shares)))
        # every dp rank holds as many rows (checked above) and no rank plans more microbatches than
        # it has rows, so splitting always reaches the count: no rank runs an empty pass (whose
        # ``0 * log-prob`` backward would be NaN wherever a log-prob is -inf)
        assert all(spread), "equal rows per dp rank split into as many microbatches on every rank"
        return on_device, norm, spread

    def _forward(
        self, mb: Microbatch, *, entropy: bool, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with targets_checked():  # check_batch read the token ids, once per step
            result: Any = token_logprobs(  # type: ignore[call-overload]  # entropy is a bool here, not a Literal
                self.model,
                mb.input_ids,
                attention_mask=mb.attention_mask,
                cu_seqlens=mb.cu_seqlens,
                mesh=self.mesh,
                temperature=temperature,
                entropy=entropy,
                document_bounds=mb.starts,
            )
        if isinstance(result, tuple):
            return mb.unpack(result[0]), mb.unpack(result[1])
        return mb.unpack(result), None

    def _agree(self, check: Callable[[], Any]) -> Any:
        """``check()`` on every rank; when it raised on any, a ``BatchError`` on every rank that
        names the first rank's problem (no rank goes on to a collective the others skip)."""
        problem = ""
        result = None
        try:
            result = check()
        except BatchError as exc:
            problem = str(exc)
        found = first_problem(problem, self.device)
        if found is not None:
            rank, first = found
            raise BatchError(f"rank {rank}: {first}")
        return result

    def _settle(
        self,
        refused: str,
        finite: list[torch.Tensor],
        loss: torch.Tensor,
        metrics: Mapping[str, torch.Tensor | float],
        shares: int,
    ) -> tuple[bool, float, dict[str, float]]:
        """After the last backward: (whether any rank's loss was not finite, the loss and the
        metrics summed over the ``shares`` of the global batch; every other rank holds a copy of
        one). First one fixed-size all-reduce of the verdicts -- whether any rank refused a
        microbatch's loss (then every rank raises the first rank's refusal, before any metric is
        reduced) -- and of the metric names' fingerprint (``agreed_names``); then one all-reduce
        of the loss and each metric by name, sorted, 0 where a rank's loss gave no such metric."""
        names = sorted(metrics)
        verdicts = [torch.tensor(float(bool(refused)), device=self.device), (~torch.stack(finite)).any()]
        prints = torch.tensor(name_fingerprint(names), dtype=torch.float64, device=self.device)
        header = torch.cat([torch.stack(verdicts).to(torch.float64), prints])  # no read of the device
        dist.all_reduce(header)
        out = header.tolist()
        if out[0]:
            self._agree(partial(_raise_if, refused))
        names = agreed_names(names, out[2:])
        values = [loss, *(metrics.get(name, 0.0) for name in names)]
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in values])
        dist.all_reduce(t)
        copies = dist.get_world_size() // shares
        reduced = [v / copies for v in t.tolist()]
        return out[1] > 0, reduced[0], dict(zip(names, reduced[1:], strict=True))

    def _raise_non_finite(self, finite: list[torch.Tensor], loss: float, grad_norm: float) -> None:
        """A ``NonFiniteError`` on every rank (each calls it: the verdict was reduced), naming
        this rank's first microbatch whose loss is not finite and the first parameter (in model
        order, over all ranks) whose gradient is not."""
        bad = (~torch.stack(finite)).nonzero().flatten().tolist()
        parameter = first_non_finite(((n, p.grad) for n, p in self.model.named_parameters()), self.device)
        raise NonFiniteError(loss=loss, grad_norm=grad_norm, microbatch=bad[0] if bad else None, parameter=parameter)

    def _shards(self) -> list[torch.Tensor]:
        """This rank's storage of every parameter, in order (written in place by swaps)."""
        return shards.local_shards(self.model)


class _TokenTerms:
    """A ``token_loss`` as the fused evaluator calls it, once per chunk of tokens: each chunk's
    fields sliced out, its metrics summed, and a refusal (the caller's function failed) noted
    rather than raised -- the evaluator runs collectives between chunks, and every rank must
    reach them all; the step is refused on every rank after the last backward."""

    def __init__(self, fn: TokenLoss, tokens: dict[str, torch.Tensor], norm: Norm, microbatch: int) -> None:
        self.fn, self.tokens, self.norm, self.microbatch = fn, tokens, norm, microbatch
        self.metrics: dict[str, torch.Tensor | float] = {}
        self.problem = ""

    def __call__(self, lp: torch.Tensor, index: slice) -> torch.Tensor:
        if not self.problem:
            fields = {name: value[index] for name, value in self.tokens.items()}
            try:
                loss, metrics = call_loss(self.fn, lp, fields, self.norm, self.microbatch)
            except BatchError as exc:
                self.problem = str(exc)
            else:
                for key, value in metrics.items():
                    self.metrics[key] = self.metrics.get(key, 0.0) + value
                return loss
        # nothing, with a finite gradient of 0 (a log-prob may be -inf)
        return torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp)).sum() * 0


def name_fingerprint(names: Sequence[str]) -> list[float]:
    """``[n, n^2, a, a^2, b, b^2]`` of a sorted list of metric names (``a``, ``b``: two 20-bit
    checksums of them): summed over the ranks, these say whether every rank has the same list
    (``agreed_names``). Exact in float64 for up to 2^12 ranks."""
    text = "\0".join(names).encode()
    parts = [len(names), zlib.crc32(text) & 0xFFFFF, zlib.adler32(text) & 0xFFFFF]
    return [float(v) for part in parts for v in (part, part * part)]


def agreed_names(names: list[str], summed: Sequence[float]) -> list[str]:
    """Collective: the metric names every rank reduces, in one order. When each rank's list is
    the same (the sums of ``name_fingerprint`` say so: ``sum(x)^2 == world * sum(x^2)`` holds
    only when every rank's ``x`` is equal), its own list; otherwise -- a metric a loss gives
    only on some ranks, ``if clipped.any(): m["clip_frac"] = ...`` -- the sorted union, gathered
    (a name a rank lacks counts 0 there). Never a reduction of tensors of different lengths, or
    of the same names in another order."""
    world = dist.get_world_size()
    pairs = [(round(summed[i]), round(summed[i + 1])) for i in range(0, len(summed), 2)]
    if all(total * total == world * squares for total, squares in pairs):
        return names
    every: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(every, names)
    return sorted({name for own in every for name in own})


def _raise_if(problem: str) -> None:
    if problem:
        raise BatchError(problem)
