"""The weights out of a parallelized model, three ways, one failure rule: ``WeightTransport``.

- **plain**: every policy rank gathers the weights bucket by bucket, rank 0 broadcasts each one
  over a ``WeightChannel`` to the receivers (``engine.channel``);
- **resharded**: each receiver gets only its own shard, point to point from the policy ranks
  that hold it (``engine.reshard``);
- **colocated**: rank 0 shares each gathered bucket by handle with a consumer on the same
  device (CUDA IPC, or shared memory on the CPU; ``engine.colocated``).

One failure rule for all three (``engine.refit_agreement``): a problem on any policy rank -- rank 0's
hand-out, another rank's gather or send -- is noted, and at the next settle the earliest one is
raised on every rank as the same ``WeightChannelError``, naming the rank, the bucket (or
transfer) and the cause. A missing channel is such a problem too (a resharded refit's, agreed
before anything is sent). The caller (``Policy``) reshards the model first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from ..models import architecture_of
from ..runtime.lora import adapters_of
from .bucket import Bucket
from .channel import WeightChannel, WeightChannelError, handshake, make_manifest, send_buckets
from .colocated import share_buckets
from .export import export_hf
from .refit_agreement import AgreedRefitError, RefitAgreement, first_problem
from .reshard import send_shards
from .streaming import GPU_AGREE_EVERY, ValueOf, WeightFormat, manifest_buckets, weight_buckets

Buckets = Iterator[Bucket]


class WeightTransport:
    """The weights of ``model`` out to an inference engine (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        config: PretrainedConfig,
        device: str,
        *,
        values: ValueOf | None = None,
        held: nn.Module | None = None,
    ) -> None:
        """``model``: what is streamed (names, tied weights, conversions). With pipeline stages it
        is the whole model on meta, ``values`` gives each full tensor (its stage's ranks gather it)
        and ``held`` is this rank's stages (``engine.pipeline.stage_values``)."""
        self.model, self.config, self.device = model, config, device
        self.values, self.held = values, held or model

    def export(self, folder: str | Path, *, source: str | Path | None, adapters_only: bool) -> None:
        """The weights as a ``save_pretrained`` folder (``engine.export``)."""
        export_hf(
            self.model,
            self.config,
            folder,
            source=source,
            adapters_only=adapters_only,
            values=self.values,
            held=self.held,
        )

    def stream(self, out: WeightFormat) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)``, gathered one bucket at a time (collective), under the one
        failure rule: the ranks settle before every ``agree_every``-th bucket's gather and at the
        end. A consumer that raises (or stops iterating) on one rank closes its generator there
        (CPython closes it as the exception leaves the loop that held it): that rank notes it and
        goes on with the gathers to the next settle, so its peers raise an ``AgreedRefitError``
        naming it there instead of waiting in a gather for the process group's timeout; the
        consumer's own exception goes on on its rank."""
        agreement = self._agreement(out)
        buckets = self._buckets(out, agreement)
        try:
            for bucket in buckets:
                yield from bucket  # each gathered as it is taken: none is held here once handed on
        except GeneratorExit:
            if not agreement.settled:  # the consumer left mid-stream; the peers are at a settle
                agreement.note(WeightChannelError("the consumer stopped taking weights (it raised or broke off)"))
                with contextlib.suppress(AgreedRefitError):
                    for _ in buckets:  # the peers' gathers, up to the settle that raises on every rank
                        pass
                    agreement.settle()
            raise
        agreement.settle()

    def manifest(self, out: WeightFormat) -> dict[str, Any]:
        """What ``send`` sends, as JSON-serialisable data (local: nothing is gathered)."""
        buckets = manifest_buckets(
            self.model, bucket_bytes=out.bucket_bytes, dtype=out.dtype, adapters_only=out.adapters_only
        )
        manifest = make_manifest(
            buckets, model=architecture_of(self.config), config=self.config.to_dict(), dtype=out.dtype
        )
        adapters = adapters_of(self.model)
        if out.adapters_only and adapters is not None:  # what the engine's LoRA loader needs beside the tensors
            manifest["adapter_config"] = adapters.spec.peft_config(adapters.modules)
        return manifest

    def send(self, channel: WeightChannel | None, out: WeightFormat, *, reshard: bool) -> int:
        """Plain (rank 0 passes the channel) or resharded (every rank passes it). Bytes sent.
        A refit that fails after the manifest handshake leaves the channel broken
        (``WeightChannel.broken``): its receivers are mid-transfer or gone, so it carries nothing
        more and closes without waiting the timeout for them."""
        if reshard:
            self._require(
                not out.adapters_only,
                "a resharded refit sends the merged weights (the receivers' model has no adapters): "
                "send adapters_only=True plain, from rank 0",
            )
            self._require(channel is not None, "a resharded refit sends from every policy rank: each joins the channel")
            assert channel is not None  # _require raised on every rank otherwise
            # manifests that differ fail on both sides alike: the channel stays whole
            handshake(channel, self.manifest(out))
            try:
                receivers = channel.world_size - dist.get_world_size()
                return send_shards(
                    channel,
                    self.model,
                    receivers=receivers,
                    dtype=out.dtype,
                    device=self.device,
                    bucket_bytes=out.bucket_bytes,
                    held=self.held,
                    values=self.values,
                )
            except Exception:
                channel.broken = True
                raise

        def send(manifest: dict[str, Any], buckets: Buckets) -> int:
            if channel is None:  # noted like any hand-out failure: raised on every rank, agreed
                raise WeightChannelError(
                    "the policy's rank 0 sends: pass it the weight channel (plancc.weight_channel)"
                )
            return send_buckets(channel, manifest, buckets)

        return self._from_rank0(send, out)

    def share(self, connection: Any, out: WeightFormat, *, timeout: float) -> int:
        """Colocated: rank 0 shares each bucket by handle over ``connection``. Bytes shared."""

        def share(manifest: dict[str, Any], buckets: Buckets) -> int:
            return share_buckets(connection, manifest, buckets, self.device, timeout=timeout)

        return self._from_rank0(share, out)

    def _from_rank0(self, hand_out: Callable[[dict[str, Any], Buckets], int], out: WeightFormat) -> int:
        """Every rank gathers the weights bucket by bucket (collective); rank 0 hands each one
        out as it comes. Any exception on any rank is raised on every rank, agreed."""
        agreement = self._agreement(out)
        buckets = self._buckets(out, agreement)
        sent = 0
        if dist.get_rank() == 0:
            try:
                sent = hand_out(self.manifest(out), buckets)
            except Exception as exc:  # noted; raised on every rank at the next settle
                agreement.note(exc)
        for _ in buckets:  # the gathers are collective: every rank runs them until a settle says stop
            pass
        agreement.settle()
        return sent

    def _agreement(self, out: WeightFormat) -> RefitAgreement:
        every = out.agree_every or (1 if torch.device(self.device).type == "cpu" else GPU_AGREE_EVERY)
        return RefitAgreement(self.device, every=every)

    def _buckets(self, out: WeightFormat, agreement: RefitAgreement) -> Buckets:
        return weight_buckets(
            self.model,
            bucket_bytes=out.bucket_bytes,
            dtype=out.dtype,
            agreement=agreement,
            adapters_only=out.adapters_only,
            values=self.values,
        )

    def _require(self, holds: bool, problem: str) -> None:
        """Collective: a ``WeightChannelError`` on every rank when ``holds`` is false on any."""
        found = first_problem("" if holds else f"rank {dist.get_rank()}: {problem}", self.device)
        if found is not None:
            raise WeightChannelError(found[1])
