"""The worker of `plancc apply`: one process per rank, started by torch's elastic launcher.

build mesh -> meta model -> parallelize with the plan -> weights (HF folder or seeded init)
-> [resume] -> train K steps (AdamW, global-norm clipping, warmup+cosine LR) -> [save]
-> summary. With ``verify`` it trains alongside an unsharded reference and compares.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    plan: str
    model: str | None = None
    dp: int | None = None
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    steps: int = 5
    data: str | None = None
    batch_size: int = 4  # global, split over dp
    seq_len: int = 32
    lr: float = 1e-3
    warmup_steps: int = 1
    schedule_steps: int | None = None  # LR schedule horizon; default: resumed step + steps
    max_grad_norm: float = 1.0
    seed: int = 0
    save: str | None = None
    resume: str | None = None
    export_hf: str | None = None
    verify: bool = False
    mode: str = "train"  # train | logprobs
    out: str | None = None  # logprobs: JSONL output path
    pack: bool = False  # logprobs: pack each batch's sequences into one row (cu_seqlens)
    device: str | None = None  # cpu or cuda; default: cuda when available
    param_dtype: str | None = None  # e.g. bfloat16 for FSDP mixed precision
    timeout_s: int = 300  # collectives time out instead of hanging a job


def lr_lambda(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


class _Progress:
    """A rich progress bar on a terminal (rank 0); one plain line per step otherwise, so
    logs and tests read the same numbers."""

    def __init__(self, total: int):
        self.bar = None
        if dist.get_rank() == 0 and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total)
            self.bar.start()

    def step(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line)
            self.bar.advance(self.task)
        else:
            log(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _init(cfg: RunConfig) -> str:
    from .mesh import default_device_type

    device = cfg.device or default_device_type()
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return device


def _load_weights(cfg: RunConfig, model, config, device: str) -> str:
    """Fill a parallelized meta model; returns where its weights came from."""
    from pathlib import Path

    from .models import build_model
    from .parallelize import materialize
    from .weights import has_safetensors, load_hf_weights

    if cfg.model and Path(cfg.model).is_dir() and has_safetensors(cfg.model):
        materialize(model, device)
        load_hf_weights(model, cfg.model)
        return f"safetensors from {cfg.model}"
    # Seeded init, identical to an unsharded model built with the same seed: every rank
    # builds the full model on the CPU and keeps its shards (fine for presets and tests;
    # real models come from a folder).
    torch.manual_seed(cfg.seed)
    full = build_model(config, device="cpu")
    state = {k: v.to(device) for k, v in full.state_dict().items()}
    del full
    materialize(model, device, full_state_dict=state)
    return f"random init (seed {cfg.seed})"


def _batches(cfg: RunConfig, dataset, vocab_size: int, start: int, count: int):
    from .data import dataset_batch, synthetic_batch

    for step in range(start, start + count):
        if dataset is None:
            ids = synthetic_batch(step, seed=cfg.seed, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                  vocab_size=vocab_size)
            yield ids, torch.ones_like(ids)
        else:
            yield dataset_batch(dataset, step, batch_size=cfg.batch_size, seq_len=cfg.seq_len)


@dataclass(kw_only=True, slots=True)
class _Job:
    """What every worker mode starts from: process group, mesh, plan, model config."""

    device: str
    mesh: object
    plan: object
    model_name: str
    config: object
    dataset: object = None  # the --data file, read and validated once


def _setup(cfg: RunConfig) -> _Job:
    from .mesh import build_mesh
    from .models import default_preset, load_config
    from .plan import load_plan

    device = _init(cfg)
    mesh = build_mesh(dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, device_type=device)
    plan = load_plan(cfg.plan)
    model_name = cfg.model or default_preset(plan.architectures, tiny=True)
    config = load_config(model_name)
    dataset = None
    if cfg.data:  # validate the whole file before any step (and before allocating the model)
        from .data import read_jsonl

        dataset = read_jsonl(cfg.data, vocab_size=config.vocab_size)
    return _Job(device=device, mesh=mesh, plan=plan, model_name=model_name, config=config, dataset=dataset)


def _parallel_model(cfg: RunConfig, job: _Job):
    """The model built on meta, parallelized with the plan and filled; (model, weight source)."""
    from .models import build_model
    from .parallelize import parallelize

    dtype = getattr(torch, cfg.param_dtype) if cfg.param_dtype else None
    model = build_model(copy.deepcopy(job.config), device="meta")  # its own config: cp changes it
    parallelize(model, job.plan, job.mesh, sequence_parallel=cfg.sequence_parallel, param_dtype=dtype)
    return model, _load_weights(cfg, model, job.config, job.device)


def train(cfg: RunConfig) -> dict:
    from . import checkpoint, faults
    from .gradnorm import clip_grad_norm_
    from .models import architecture_of
    from .verify import batch_slice, reported_loss, sharded_loss

    job = _setup(cfg)
    device, mesh, plan, model_name, config = job.device, job.mesh, job.plan, job.model_name, job.config
    model, source = _parallel_model(cfg, job)
    sizes = {axis: mesh[axis].size() for axis in ("dp", "cp", "tp")}
    log(f"plancc apply: {plan.name} on {model_name} | world {dist.get_world_size()} "
        f"dp={sizes['dp']} cp={sizes['cp']} tp={sizes['tp']}{' +sp' if cfg.sequence_parallel else ''} "
        f"| {device} | weights: {source}")

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    start = 0
    if cfg.resume:
        info = checkpoint.load(cfg.resume, model, opt, architecture=architecture_of(config), plan=plan.name)
        start = info.step
        log(f"resumed from step {info.step} (saved at dp={info.dp} cp={info.cp} tp={info.tp})")
    total = start + cfg.steps
    horizon = cfg.schedule_steps or total
    for group in opt.param_groups:  # the base LR is configuration, not checkpointed state
        group["initial_lr"] = cfg.lr
    # The schedule is a function of the global step, so a resumed run needs no stored state.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s + start, warmup=cfg.warmup_steps, total=horizon))
    mine = batch_slice(mesh, cfg.batch_size)
    history = []
    progress = _Progress(total - start)
    t_start = time.perf_counter()
    for step, (ids, mask) in enumerate(_batches(cfg, job.dataset, config.vocab_size, start, cfg.steps), start=start):
        faults.inject("train", rank=dist.get_rank(), step=step + 1)
        t0 = time.perf_counter()
        ids, mask = ids[mine].to(device), mask[mine].to(device)
        loss, _ = sharded_loss(model, ids, mask, mesh)
        loss.backward()
        grad_norm = clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        mean_loss = reported_loss(loss, mesh)
        dt = time.perf_counter() - t0
        tokens = int(mask.sum()) * mesh["dp"].size()
        history.append({"step": step + 1, "loss": mean_loss, "grad_norm": float(grad_norm),
                        "lr": sched.get_last_lr()[0], "tokens_per_s": tokens / dt})
        progress.step(f"step {step + 1:>4}/{total}  loss {mean_loss:.6f}  grad_norm {float(grad_norm):.4f}  "
                      f"lr {sched.get_last_lr()[0]:.2e}  tok/s {tokens / dt:,.0f}")
    progress.close()
    elapsed = time.perf_counter() - t_start
    if cfg.save:
        path = checkpoint.save(cfg.save, model, opt, checkpoint.CheckpointInfo(
            step=total, architecture=architecture_of(config), model_signature=checkpoint.model_signature(model),
            plan=plan.name, **sizes))
        log(f"saved checkpoint {path}")
    if cfg.export_hf:
        from .weights import export_hf

        export_hf(model, config, cfg.export_hf)
        log(f"exported Hugging Face weights to {cfg.export_hf}")
    summary = {"steps": cfg.steps, "first_loss": history[0]["loss"] if history else None,
               "last_loss": history[-1]["loss"] if history else None, "seconds": elapsed,
               "history": history}
    log(f"summary: {cfg.steps} steps in {elapsed:.1f}s, loss {summary['first_loss']:.4f} -> "
        f"{summary['last_loss']:.4f}" if history else "summary: no steps")
    return summary


def run_verify(cfg: RunConfig) -> dict:
    from .verify import TOLERANCES, verify_against_unsharded, within_tolerance

    job = _setup(cfg)
    device, mesh, plan, model_name, config = job.device, job.mesh, job.plan, job.model_name, job.config
    batches = list(_batches(cfg, job.dataset, config.vocab_size, 0, cfg.steps + 1))
    report = verify_against_unsharded(plan, model_name, mesh, sequence_parallel=cfg.sequence_parallel,
                                      steps=cfg.steps, seed=cfg.seed, lr=cfg.lr, max_grad_norm=cfg.max_grad_norm,
                                      batches=batches, device=device)
    ok = within_tolerance(report)
    flags = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    log(f"verify {plan.name} on {model_name} (dp={mesh['dp'].size()} cp={mesh['cp'].size()} "
        f"tp={mesh['tp'].size()}{' +sp' if cfg.sequence_parallel else ''}) against the unsharded model:")
    log(f"  logits  max |diff| {report.logits_max_abs:.3e}  relative {report.logits_max_rel:.3e}  "
        f"(tolerance {TOLERANCES['logits_rel']:.0e})")
    log(f"  loss    |diff| {report.loss_abs:.3e}  (tolerance {TOLERANCES['loss_abs']:.0e})")
    log(f"  grads   max relative diff {report.grad_max_rel:.3e} in {report.worst_grad}  "
        f"over {report.params_compared} parameters (tolerance {TOLERANCES['grad_rel']:.0e})")
    for i, d in enumerate(report.step_loss_abs, start=1):
        log(f"  loss after step {i}: |diff| {d:.3e}")
    log(f"  replicated parameters identical across tp ranks: {report.replicas_identical}")
    log("verify: OK" if bool(flags.item()) else "verify: FAILED (beyond tolerance)")
    return {"ok": bool(flags.item()), **report.as_dict()}


def _reference_model(cfg: RunConfig, config, device: str):
    """The unsharded model with the same weights as the parallelized one."""
    from pathlib import Path

    from .models import build_model
    from .weights import has_safetensors

    if cfg.model and Path(cfg.model).is_dir() and has_safetensors(cfg.model):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(cfg.model).to(device)
    torch.manual_seed(cfg.seed)
    # CPU init: the same weights on any device. A config of its own: cp switches the
    # attention implementation on the parallelized model's config.
    return build_model(copy.deepcopy(config), device="cpu").to(device)


def _padded_batch(seqs, multiple: int):
    """Right-padded rows, as long as the longest sequence rounded up to ``multiple``."""
    width = -(-max(len(x) for x in seqs) // multiple) * multiple
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = torch.tensor(seq)
        mask[r, : len(seq)] = 1
    return ids, mask, None


def _packed_batch(seqs, multiple: int):
    """One row of documents, each padded to ``multiple`` (cp shards every document), with
    its cumulative lengths. Padding follows each document, so causal attention keeps it out
    of the document's own log-probs."""
    lengths = [-(-len(x) // multiple) * multiple for x in seqs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.zeros((1, int(cu[-1])), dtype=torch.long)
    for r, seq in enumerate(seqs):
        ids[0, int(cu[r]): int(cu[r]) + len(seq)] = torch.tensor(seq)
    return ids, None, cu


def run_logprobs(cfg: RunConfig) -> dict:
    """Per-token log-probs of every line of ``cfg.data`` (rank 0 writes ``cfg.out``)."""
    from .logprobs import token_logprobs

    job = _setup(cfg)
    device, mesh, plan, model_name, config = job.device, job.mesh, job.plan, job.model_name, job.config
    dataset = job.dataset
    model, source = _parallel_model(cfg, job)
    model.eval()
    reference = _reference_model(cfg, config, device).eval() if cfg.verify else None
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    # Sequence lengths must split evenly over the sequence-sharding ranks (SP: tp; CP: 2*cp).
    multiple = (mesh["tp"].size() if cfg.sequence_parallel else 1) * (2 * cfg.cp if cfg.cp > 1 else 1)
    mine = list(range(dp_rank, len(dataset.sequences), dp))
    results: dict[int, list[float]] = {}
    worst = 0.0
    for lo in range(0, len(mine), cfg.batch_size):
        rows = mine[lo:lo + cfg.batch_size]
        seqs = [dataset.sequences[i] for i in rows]
        batch = _packed_batch(seqs, multiple) if cfg.pack else _padded_batch(seqs, multiple)
        ids, mask, cu = (t.to(device) if t is not None else None for t in batch)
        with torch.no_grad():
            lp = token_logprobs(model, ids, attention_mask=mask, cu_seqlens=cu, mesh=mesh,
                                cp=mesh if cfg.cp > 1 else None)
            if reference is not None:
                want = token_logprobs(reference, ids, attention_mask=mask, cu_seqlens=cu)
                worst = max(worst, (lp - want).abs().max().item())
        for r, i in enumerate(rows):
            if cu is None:
                results[i] = lp[r, : len(seqs[r])].tolist()
            else:
                start = int(cu[r])
                results[i] = lp[0, start: start + len(seqs[r])].tolist()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    worst_t = torch.tensor([worst], device=device)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    worst = worst_t.item()
    merged: dict[int, list[float]] = {}
    for part in gathered:
        merged.update(part)
    if dist.get_rank() == 0 and cfg.out:
        with open(cfg.out, "w") as f:
            for i in range(len(dataset.sequences)):
                f.write(json.dumps({"logprobs": merged[i]}) + "\n")
    log(f"plancc logprobs: {plan.name} on {model_name} | dp={dp} cp={mesh['cp'].size()} tp={mesh['tp'].size()}"
        f"{' +sp' if cfg.sequence_parallel else ''} | weights: {source} | {len(merged)} sequences"
        + (f" -> {cfg.out}" if cfg.out else ""))
    ok = True
    if cfg.verify:
        ok = worst <= 1e-5
        log(f"verify: max |logprob diff| vs the unsharded model {worst:.3e} (tolerance 1e-05): "
            + ("OK" if ok else "FAILED"))
    return {"ok": ok, "max_abs_diff": worst if cfg.verify else None, "sequences": len(merged)}


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = argparse.ArgumentParser(prog="plancc-worker")
    parser.add_argument("--config", required=True, help="RunConfig as JSON")
    parser.add_argument("--result", help="rank 0 writes its result here as JSON")
    args = parser.parse_args(argv)
    cfg = RunConfig(**json.loads(args.config))

    @record
    def worker() -> dict:
        try:
            if cfg.mode == "logprobs":
                return run_logprobs(cfg)
            return run_verify(cfg) if cfg.verify else train(cfg)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    result = worker()
    if args.result and int(os.environ.get("RANK", "0")) == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0 if result.get("ok", True) else 3


if __name__ == "__main__":
    code = main()
    # Skip interpreter finalization, as multiprocessing's workers do: after a DCP load on
    # gloo (torch 2.13) a C++ thread still joinable at exit aborts the process with
    # "terminate called without an active exception", turning a finished run into SIGABRT.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
