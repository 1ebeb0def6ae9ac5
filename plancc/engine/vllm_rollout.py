"""vLLM as the rollout engine: its own process and environment, plancc's weights into it through
vLLM's weight-transfer protocol, and the trainer's log-probs of its samples checked every refit.

vLLM pins another transformers than plancc, so it runs from its own environment
(``scripts/vllm_env.sh``) as a subprocess of the driving trainer rank (rank 0):
``plancc_vllm.server``, connected back over ``multiprocessing.connection``. It starts from the
policy's config with dummy weights; every ``refit`` sends the policy's weights:

- vLLM's four phases: ``init_weight_transfer_engine`` once, then per refit
  ``start_weight_update``, ``update_weights`` (each worker its own update info) and
  ``finish_weight_update`` with the version;
- the data plane is the ``plancc_gloo`` backend (``plancc_vllm.engine``, registered through
  vLLM's plugin entry point): a gloo group of the driver and every vLLM worker, weight by weight
  in checkpoint names (the iterable ``Policy.weights`` yields, gathered bucket by bucket over the
  policy's ranks at any layout), each worker sent only the slice its tensor-parallel rank loads
  (``vllm_slice``);
- the version vLLM serves is the last refit that finished; a refit that failed part-way is
  reported by the server, which refuses to sample until a refit completes.

``agreement`` is the number RL teams watch (NeMo-RL's ``token_mult_prob_error``): the policy's
log-probs of vLLM's sampled tokens against the log-probs vLLM returned with them.

Collective: every policy rank constructs the rollout and calls ``refit``, ``generate`` and
``agreement`` (the driver talks to vLLM; the others take part in the policy's gathers and get the
samples broadcast).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .streaming import WeightFormat

BACKEND = "plancc_gloo"
TAG = 7  # plancc_vllm.engine.TAG: the weights' messages
# vLLM pads the vocabulary of its embedding and head to a multiple of this before splitting it
VOCAB_PADDING = 64
# vLLM's samples arrive as host lists; the batch made of them goes to the policy, which places it
HOST = torch.device("cpu")


class RolloutError(RuntimeError):
    """vLLM refused, failed or disagreed; the message names what."""


@dataclass(frozen=True, slots=True)
class VLLMSpec:
    """How to start vLLM: its environment's interpreter and the engine's settings."""

    python: str  # the vLLM environment's python (scripts/vllm_env.sh prints it)
    # a Hugging Face folder vLLM starts from (its config; the first refit brings the weights);
    # None: the policy's own config, written for it. A folder's model must be the policy's:
    # checked before any weight moves (``same_model``)
    model: str | None = None
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    # vLLM's gpu_memory_utilization: on the CPU the fraction of host memory for the KV cache
    memory_fraction: float = 0.08
    max_model_len: int | None = None  # None: the config's max_position_embeddings, at most 4096
    seed: int = 0
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    env: dict[str, str] = field(default_factory=dict)  # more environment for vLLM's processes

    def llm_kwargs(self, folder: str, config: Any) -> dict[str, Any]:
        longest = int(getattr(config, "max_position_embeddings", None) or 4096)
        kwargs: dict[str, Any] = {
            "model": folder,
            "skip_tokenizer_init": True,
            "dtype": self.dtype,
            "enforce_eager": True,
            "gpu_memory_utilization": self.memory_fraction,
            "max_model_len": self.max_model_len or min(longest, 4096),
            "tensor_parallel_size": self.tensor_parallel_size,
            "seed": self.seed,
            "load_format": "dummy",  # the first refit brings the weights
        }
        if self.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"
        return kwargs


# Checkpoint projections vLLM splits by output rows (column-parallel; the query, gate and up
# projections that it fuses, each expert's and shared expert's included, and MLA's up-projections
# of queries and of keys/values, head by head) and by input columns (row-parallel). The key/value
# projections follow their heads. MLA's down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``)
# and the routers are replicated. Mixtral names its experts' projections w1 (gate), w3 (up), w2.
COLUMN = ("q_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
ROW = ("o_proj", "down_proj")
MIXTRAL_COLUMN = ("w1", "w3")
MIXTRAL_ROW = ("w2",)


def vllm_slice(name: str, shape: tuple[int, ...], rank: int, size: int, config: Any) -> list[int] | None:
    """``[dim, start, length]`` of checkpoint tensor ``name`` that rank ``rank`` of vLLM's tensor
    parallelism of ``size`` loads, or None for the whole (replicated, or not known here: the
    whole is always right, only larger). vLLM's own loaders cut the same range again."""
    if size == 1 or len(shape) == 0:
        return None
    leaf = name.rsplit(".", 2)
    module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", "")
    if module in ("embed_tokens", "lm_head") and kind == "weight":
        vocab = shape[0]
        per = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // size
        start, end = min(rank * per, vocab), min((rank + 1) * per, vocab)
        return [0, start, end - start]
    if module in COLUMN or (module in MIXTRAL_COLUMN and ".experts." in name):
        per = shape[0] // size
        return [0, rank * per, per]
    if module in ("k_proj", "v_proj"):
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        width = shape[0] // heads
        if size >= heads:  # vLLM replicates each key/value head over size / heads ranks
            head = rank // (size // heads)
            return [0, head * width, width]
        per = shape[0] // size
        return [0, rank * per, per]
    if (module in ROW or (module in MIXTRAL_ROW and ".experts." in name)) and kind == "weight":
        per = shape[1] // size
        return [1, rank * per, per]
    return None


# What makes two configs one model for the refit: every weight's name and shape follows from them.
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
)


# Fields the pinned transformers no longer writes and vLLM's model code still reads, with the
# value that states what transformers' model computes. DeepSeek-V3's router always adds its
# expert score correction (transformers dropped ``topk_method``); vLLM creates that bias only
# for ``noaux_tc`` and otherwise refuses the checkpoint's ``e_score_correction_bias``.
VLLM_CONFIG_FIELDS = {"deepseek_v3": {"topk_method": "noaux_tc"}}


def vllm_config(config: Any) -> dict[str, Any]:
    """The policy's config as vLLM reads it (``config.json`` of the folder vLLM starts from)."""
    out = config.to_dict()
    out.pop("transformers_version", None)
    for key, value in VLLM_CONFIG_FIELDS.get(out.get("model_type", ""), {}).items():
        out.setdefault(key, value)
    return out


def same_model(policy: Any, served: dict[str, Any]) -> str | None:
    """The first difference between the policy's config and the one vLLM serves (None: the
    same model for the refit): a name or a shape of some weight would differ."""
    mine = policy.to_dict()
    for key in SHAPE_FIELDS:
        if (key in mine or key in served) and mine.get(key) != served.get(key):
            return f"{key}: the policy has {mine.get(key)!r}, vLLM serves {served.get(key)!r}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _is_driver() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _broadcast(value: Any) -> Any:
    """The driver's ``value`` on every policy rank (the driver raises what it raised, everywhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class VLLMRollout:
    """A running vLLM fed by a policy: ``refit`` (weights in, a version), ``generate`` (samples
    with vLLM's log-probs), ``agreement`` (the policy's log-probs of them). Collective."""

    def __init__(self, spec: VLLMSpec, config: Any) -> None:
        self.spec = spec
        self.config = config
        self.workers = spec.tensor_parallel_size
        self.driver = _is_driver()
        self.version: str | None = None
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._group: Any = None
        self._store: Any = None
        self._refits = 0
        self._folder = tempfile.TemporaryDirectory(prefix="plancc-vllm-")
        self.stats_dir = os.path.join(self._folder.name, "stats")
        failure = None
        if self.driver:
            try:
                self._start()
            except Exception as error:  # every rank raises it
                failure = str(error)
                self.close()
        failure = _broadcast(failure)
        if failure:
            raise RolloutError(failure)

    # ------------------------------------------------------------------ process
    def _start(self) -> None:
        if not os.path.exists(self.spec.python):
            raise RolloutError(
                f"no vLLM environment at {self.spec.python}: bash scripts/vllm_env.sh builds one and prints "
                "its python (vLLM pins another transformers than plancc: it runs from its own venv)"
            )
        os.makedirs(self.stats_dir)
        folder = self.spec.model
        if folder is None:  # the policy's config, and dummy weights until the first refit
            folder = os.path.join(self._folder.name, "model")
            os.makedirs(folder)
            Path(folder, "config.json").write_text(json.dumps(vllm_config(self.config), indent=1))
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = {
            **os.environ,
            **self.spec.env,
            "PLANCC_VLLM_ADDRESS": f"{listener.address[0]}:{listener.address[1]}",
            "PLANCC_VLLM_AUTHKEY": key.hex(),
        }
        env.pop("PYTHONPATH", None)  # vLLM's environment has its own packages (and plancc_vllm)
        if self.workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env and not torch.cuda.is_available():
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(self.workers))
        # a session of its own: vLLM's engine core and workers are its children, and a server that
        # died (killed, out of memory) leaves them running -- 1.5 GB each here -- unless the
        # whole group is stopped (``close``)
        command = [self.spec.python, "-m", "plancc_vllm.server"]
        self._process = subprocess.Popen(command, env=env, start_new_session=True)
        self._conn = self._accept(listener)
        self._call({"llm": self.spec.llm_kwargs(folder, self.config)}, timeout=self.spec.start_timeout_s)
        served = self._call({"op": "describe"})
        difference = same_model(self.config, served["config"])
        if difference is not None:  # before any weight moves
            raise RolloutError(f"vLLM serves another model than the policy's ({folder}): {difference}")
        self._init_transfer()

    def _accept(self, listener: Listener) -> Connection:
        """vLLM's connection back, watching the process: a vLLM that exits is named at once."""
        sock = listener._listener._socket  # type: ignore[attr-defined]
        sock.settimeout(1.0)
        deadline = time.monotonic() + self.spec.start_timeout_s
        try:
            while True:
                try:
                    return listener.accept()
                except TimeoutError:
                    pass
                if self._process is not None and self._process.poll() is not None:
                    raise RolloutError(
                        f"vLLM ({self.spec.python}) exited before it connected ({self._exit()}): see its log above"
                    )
                if time.monotonic() > deadline:
                    raise RolloutError(f"vLLM did not connect within {self.spec.start_timeout_s:.0f} s")
        finally:
            listener.close()

    def _call(self, request: dict[str, Any], *, timeout: float | None = None) -> Any:
        self._send(request)
        return self._reply(timeout=timeout, what=request.get("op", "start"))

    def _send(self, request: dict[str, Any]) -> None:
        assert self._conn is not None, "the driver holds the connection"
        try:
            self._conn.send(request)
        except OSError as error:
            raise RolloutError(f"vLLM is gone ({self._exit()}): {error}") from error

    def _reply(self, *, timeout: float | None, what: str) -> Any:
        assert self._conn is not None, "the driver holds the connection"
        wait = self.spec.request_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        while not self._conn.poll(1.0):
            if self._process is not None and self._process.poll() is not None:
                raise RolloutError(f"vLLM exited during {what!r} ({self._exit()})")
            if time.monotonic() > deadline:
                raise RolloutError(f"vLLM did not answer {what!r} within {wait:.0f} s")
        try:
            reply = self._conn.recv()
        except (EOFError, OSError) as error:
            raise RolloutError(f"vLLM is gone during {what!r} ({self._exit()})") from error
        if not reply["ok"]:
            raise RolloutError(f"vLLM refused {what!r}: {reply['error']}")
        return reply["result"]

    def _exit(self) -> str:
        code = self._process.poll() if self._process is not None else None
        return "still running" if code is None else f"exit code {code}"

    def _init_transfer(self) -> None:
        port = _free_port()
        world = 1 + self.workers
        timeout = self.spec.request_timeout_s
        store = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)
        info = {"host": "127.0.0.1", "port": port, "world_size": world, "timeout_s": timeout}
        self._send({"op": "init_transfer", "init_info": {**info, "stats_dir": self.stats_dir}})
        self._group = dist.ProcessGroupGloo(dist.PrefixStore(BACKEND, store), 0, world, timedelta(seconds=timeout))
        self._store = store
        self._reply(timeout=timeout, what="init_transfer")

    # ------------------------------------------------------------------ refit
    def refit(self, policy: Any, version: str | None = None) -> dict[str, Any]:
        """The policy's weights into vLLM, as ``version`` (default: a count of refits).
        Collective over the policy's ranks. Returns the refit's seconds, bytes per worker and
        the version vLLM serves."""
        fmt = WeightFormat(dtype=getattr(torch, self.spec.dtype))
        manifest = policy.weights_manifest(fmt)
        tensors = [t for bucket in manifest["buckets"] for t in bucket["tensors"]]
        self._refits += 1
        version = version or str(self._refits)
        cuts = [
            [vllm_slice(t["name"], tuple(t["shape"]), w, self.workers, self.config) for t in tensors]
            for w in range(self.workers)
        ]
        start = time.perf_counter()
        failure = None
        if self.driver and self._group is None and self._conn is not None:  # the last refit was abandoned
            self._init_transfer()
        if self.driver:
            update = [
                {
                    "names": [t["name"] for t in tensors],
                    "dtype_names": [t["dtype"] for t in tensors],
                    "shapes": [t["shape"] for t in tensors],
                    "slices": cuts[w],
                    "version": version,
                }
                for w in range(self.workers)
            ]
            try:
                self._send({"op": "update", "update_info": update, "version": version, "stats_dir": self.stats_dir})
            except RolloutError as error:
                failure = str(error)
        try:
            sent, failure = self._stream(policy.weights(fmt), tensors, cuts, version, failure)
        except BaseException:  # this rank's policy failed mid-refit (a lost rank, a bad tensor)
            if self.driver and failure is None:
                self._abandon()
            raise
        if self.driver and failure is not None and self._group is not None:
            self._abandon()
        if self.driver and failure is None:
            try:
                self._reply(timeout=None, what="update")
            except RolloutError as error:
                failure = str(error)
        failure = _broadcast(failure)
        if failure:
            raise RolloutError(failure)
        self.version = version
        return _broadcast({"version": version, "seconds": time.perf_counter() - start, "bytes_per_worker": sent})

    def _stream(
        self, weights: Any, tensors: list[dict[str, Any]], cuts: list[list[Any]], version: str, failure: str | None
    ) -> tuple[list[int], str | None]:
        """Every rank iterates the policy's weights (its gathers); the driver sends each worker its
        slices. (Bytes sent per worker, the failure: a send that fails stops the sending, not the
        gathers, which every rank must finish.)"""
        sent = [0] * self.workers
        for index, (name, tensor) in enumerate(weights):
            if not self.driver or failure is not None:
                continue
            try:
                expected = tensors[index]["name"]
                if name != expected:
                    raise RolloutError(f"the weights came as {name!r} where the manifest has {expected!r}")
                for w in range(self.workers):
                    cut = cuts[w][index]
                    part = tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2])
                    part = part.detach().to("cpu").contiguous()
                    self._group.send([part], 1 + w, TAG).wait()
                    sent[w] += part.numel() * part.element_size()
            except Exception as error:
                failure = f"the refit to version {version!r} failed at {name!r}: {error} ({self._exit()})"
        return sent, failure

    def _abandon(self) -> None:
        """A refit that cannot finish: close the transfer group, so that vLLM's workers, waiting
        for the rest of the weights, fail now rather than at the transfer's timeout; vLLM then
        reports the refit as failed part-way (the server keeps it: ``serving``). The next refit
        joins a new group."""
        self._group = None
        self._store = None
        gc.collect()  # the group's sockets close with it
        if self._process is not None and self._process.poll() is None and self._conn is not None:
            with contextlib.suppress(RolloutError):  # expected: the update failed
                self._reply(timeout=self.spec.request_timeout_s, what="update")

    def worker_stats(self) -> list[dict[str, Any]]:
        """What each vLLM worker received in the last refit (its own count), on the driver."""
        return [json.loads(Path(self.stats_dir, f"worker{1 + w}.json").read_text()) for w in range(self.workers)]

    def serving(self) -> dict[str, Any]:
        """The version vLLM serves and a refit that failed part-way, if any (driver)."""
        return dict(self._call({"op": "version"}))

    # ------------------------------------------------------------------ sampling
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[dict[str, Any]]:
        """vLLM's samples, on every rank: per completion its prompt's index, tokens and the
        log-probs vLLM gave them."""
        result: Any = None
        if self.driver:
            try:
                request = {
                    "op": "generate",
                    "prompts": prompts,
                    "n": n,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "seed": seed,
                    "ignore_eos": ignore_eos,
                }
                result = self._call(request)
            except RolloutError as error:
                result = error
        result = _broadcast(result)
        if isinstance(result, RolloutError):
            raise result
        return list(result)

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send({"op": "shutdown"})
                self._conn.poll(30)
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        if self._process is not None:
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)  # what vLLM started and left behind
            self._process = None
        self._group = None
        self._folder.cleanup()

    def __enter__(self) -> VLLMRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rows_of(prompts: list[list[int]], completions: list[dict[str, Any]], pad: int = 0) -> dict[str, torch.Tensor]:
    """A batch of prompt + completion rows (right-padded) for the policy."""
    rows = [list(prompts[c["prompt"]]) + list(c["token_ids"]) for c in completions]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=HOST)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=HOST)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, device=HOST)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def agreement(policy: Any, prompts: list[list[int]], completions: list[dict[str, Any]]) -> dict[str, float]:
    """The policy's log-probs of vLLM's sampled tokens against vLLM's own: max and mean |diff|
    and the k3 estimate of KL(rollout || policy) (``exp(r) - 1 - r``, ``r = policy - rollout``,
    averaged over the sampled tokens). Collective over the policy's ranks."""
    batch = rows_of(prompts, completions)
    logprobs = policy.logprobs(batch)
    ours, theirs = [], []
    for i, c in enumerate(completions):
        begin = len(prompts[c["prompt"]])
        ours.append(logprobs[i, begin : begin + len(c["token_ids"])].double().cpu())
        theirs.append(torch.tensor(c["logprobs"], dtype=torch.float64, device=HOST))
    mine, vllm = torch.cat(ours), torch.cat(theirs)
    diff = mine - vllm
    return {
        "rollout_logprob_max_abs_diff": float(diff.abs().max()),
        "rollout_logprob_mean_abs_diff": float(diff.abs().mean()),
        "rollout_kl_k3": float((torch.exp(diff) - 1 - diff).mean()),
        "rollout_tokens": float(diff.numel()),
    }
