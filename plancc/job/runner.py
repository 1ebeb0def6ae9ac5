"""The worker of `plancc apply`: one process per rank, started by torch's elastic launcher.

build mesh -> meta model -> parallelize with the plan -> weights (HF folder or seeded init)
-> [resume] -> train K steps (AdamW, global-norm clipping, warmup+cosine LR) -> [save]
-> summary. With ``verify`` it trains alongside an unsharded reference and compares.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ..engine import checkpoint
from ..engine.batches import BatchError
from ..engine.losses import token_nll
from ..engine.parallel_model import from_folder, non_finite_weight_warning
from ..engine.policy import BatchTotals, NonFiniteError, Policy
from ..errors import Diagnostic, PlanError, Severity, SourceLoc, quiet_logger
from ..runtime import faults
from ..runtime.failures import diagnosed
from ..runtime.rank_agreement import on_rank0
from ..runtime.rank_memory import PeakRecorder
from . import reporting
from .config import RunConfig
from .data import (
    data_identity,
    padded_rows,
)
from .evaluation import evaluate
from .lifecycle import EXIT_FAILED, LauncherWatch, StopRequest, log_traceback
from .loggers import Trackers
from .reporting import MetricsFile, RunProgress, log
from .run_file import RUN_FILE
from .run_notes import data_note, eta_of, lora_note, memory_note, optimizer_note
from .run_record import (
    batch_shape,
    data_changes,
    run_settings,
    schedule_changes,
    shape_changes,
    tracked_settings,
)
from .run_setup import Job, global_batches, job_policy, setup_job
from .verify import (
    EXACT_FACTOR,
    TOLERANCES,
    logprobs_difference,
    unsharded_reference,
    verify_against_unsharded,
    within_tolerance,
)


@dataclass(kw_only=True, slots=True)
class _Trainer:
    """The LR schedule and step loop of one training run, over a ``plancc.Policy`` (which owns
    the model, the optimizer, the microbatching and the step itself)."""

    cfg: RunConfig
    job: Job
    policy: Policy
    start: int = 0
    done: int = 0  # the global step after the last finished step
    interrupted: int = 0  # the signal that stopped the run early, or 0
    last_checkpoint: int = -1  # the step of the newest checkpoint this run wrote
    _data: dict[str, Any] | None = None  # data_identity of the rows, found once

    @property
    def data(self) -> dict[str, Any]:
        """What a checkpoint keeps of this run's rows (``data_identity``), found the first time, on
        rank 0 alone: it writes a checkpoint's ``plancc.json`` and the log (the others: {})."""
        if self._data is None:
            self._data = data_identity(self.job.dataset) if dist.get_rank() == 0 else {}
        return self._data

    @property
    def model(self) -> nn.Module:
        return self.policy.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.policy.optimizer

    def resume(self) -> None:
        """Continue from --resume: weights, optimizer state and the schedule's position
        (``Policy.load``); the base learning rate is this run's --lr. --steps is the run's total
        (as torchtitan's ``training.steps`` and HF Trainer's ``max_steps``): the same command
        plus --resume ends where the uninterrupted run ends, on the same schedule."""
        if self.cfg.checkpoint.resume:
            info = self.policy.load(self.cfg.checkpoint.resume)
            self.start = self.done = info.step
            experts = f" ep={info.ep}" if info.ep > 1 else ""
            stages = f"pp={info.pp} " if info.pp > 1 else ""
            data = f"dp={info.dp}" if info.dp_replicate == 1 else f"dp_replicate={info.dp_replicate} dp={info.dp}"
            log(
                f"resumed from step {info.step} (saved at {stages}{data} cp={info.cp} tp={info.tp}{experts}); "
                f"training to step {self.total}"
            )
            changed = schedule_changes(info.run, run_settings(self.cfg))
            if changed:
                log(f"note: this run's {changed}: the learning rate follows this run's schedule from step {info.step}")
            other_rows = data_changes(info.run, self.data) if self.data else ""
            other_rows = other_rows or shape_changes(info.run, batch_shape(self.cfg))  # the same rows, cut otherwise
            if other_rows:
                log(
                    f"note: {other_rows}: the steps after {info.step} train on other batches than the run that "
                    "saved the checkpoint would have"
                )
            if info.step >= self.total:
                log(f"note: the checkpoint is at step {info.step}, --steps {self.total}: nothing left to train")

    @property
    def total(self) -> int:
        return self.cfg.training.steps

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.start)

    def step(self, step: int, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this rank's slice of the global batch; its metrics."""
        faults.inject("train", rank=dist.get_rank(), step=step + 1)
        poisoned = faults.poisoned("loss", rank=dist.get_rank(), step=step + 1)

        def loss_fn(lp: torch.Tensor, tokens: dict[str, torch.Tensor], norm: BatchTotals) -> tuple[torch.Tensor, dict]:
            loss, metrics = token_nll(lp, tokens, norm)
            return (loss * float("nan") if poisoned else loss), metrics

        cfg = self.cfg
        try:
            row = self.policy.train(
                batch,
                token_loss=loss_fn,  # the NLL is a sum of per-token terms: the 3-matmul lm_head
                micro_batch_size=cfg.data.micro_batch_size,
                max_tokens=cfg.data.max_tokens,
                pack=cfg.data.pack,
            )
        except NonFiniteError as exc:  # divergence, the same verdict on every rank (not a BatchError)
            raise _non_finite(step + 1, exc, cfg) from None
        except BatchError as exc:
            raise _data_problem(cfg, str(exc)) from None
        return {
            "step": step + 1,
            "loss": row["loss"],
            "grad_norm": row["grad_norm"],
            "lr": row["lr"],
            # every token the step read (prompts too), as torchtitan and `plancc suggest` count
            "tokens_per_s": row["input_tokens"] / row["seconds"],
        }

    def run(self) -> list[dict[str, float]]:
        device, history = self.job.device, []
        progress = RunProgress(self.remaining)
        trackers = Trackers(
            self.cfg.logging.loggers,
            rank0=dist.get_rank() == 0,
            run_name=f"{self.job.plan.name}-{self.job.model_name}-{self.job.layout.describe().replace(' ', '-')}",
            settings=tracked_settings(self.cfg, self.job),
            save=self.cfg.checkpoint.save,
        )
        metrics = MetricsFile(
            self.cfg.logging.metrics,
            start=self.start,
            device=device,
            tensorboard=self.cfg.logging.tensorboard,
            trackers=trackers,
        )
        batches = global_batches(self.cfg, self.job.dataset, self.job.config.vocab_size, self.start, self.remaining)
        started = time.perf_counter()
        try:
            for step, batch in enumerate(batches, start=self.start):
                self.interrupted = StopRequest.agreed(device)
                if self.interrupted:
                    break
                mine = self.policy.balanced_slices(batch["attention_mask"].sum(1))  # even tokens per dp rank
                row = self.step(step, {name: value[mine].to(device) for name, value in batch.items()})
                self.done = step + 1
                row.update(self.evaluated())
                history.append(row)
                metrics.write(row)
                shown = len(history) == 1 or self.done % self.cfg.logging.log_every == 0 or self.done == self.total
                if shown:  # --log-every N: every N-th step's line (the first and the last always)
                    eta = eta_of(time.perf_counter() - started, len(history), self.total - self.done)
                    progress.step(
                        f"step {step + 1:>4}/{self.total}  loss {row['loss']:.6f}  "
                        f"grad_norm {row['grad_norm']:.4f}  lr {row['lr']:.2e}  tok/s {row['tokens_per_s']:,.0f}  "
                        f"eta {eta}"
                    )
                else:
                    progress.advance()
                if "eval_loss" in row:
                    tokens = f"{row['eval_tokens']:,.0f}"
                    log(f"eval {self.done:>4}/{self.total}  loss {row['eval_loss']:.6f}  over {tokens} tokens")
                every = self.cfg.checkpoint.save_every
                if every and self.done % every == 0 and self.done < self.total:
                    self.save_checkpoint()
        finally:
            progress.close()
            metrics.close()
        return history

    def evaluated(self) -> dict[str, float]:
        """The eval loss after this step, when it is an --eval-every step or the last (else {})."""
        every, rows = self.cfg.eval.eval_every, self.job.eval_rows
        due = self.done == self.total or (every is not None and self.done % every == 0)
        if rows is None or not due:
            return {}
        return evaluate(self.policy, rows, batch_size=self.cfg.data.batch_size, seq_len=self.cfg.data.seq_len)

    def save_checkpoint(self) -> None:
        """A checkpoint of the steps done so far into --save (``Policy.save``: atomic, the
        schedule included), then the oldest beyond --keep removed. Collective."""
        if not self.cfg.checkpoint.save or self.last_checkpoint == self.done:
            return
        files = {RUN_FILE: self.cfg.checkpoint.run_file} if self.cfg.checkpoint.run_file else None
        run = {**run_settings(self.cfg), **self.data, **batch_shape(self.cfg)}
        path = self.policy.save(self.cfg.checkpoint.save, run=run, files=files)
        first = self.last_checkpoint < 0
        self.last_checkpoint = self.done
        keep, folder = self.cfg.checkpoint.kept_checkpoints, self.cfg.checkpoint.save
        if first:  # what stays, said once: a folder filling a disk is no surprise
            log(
                f"checkpoints: the newest {keep} in {folder} stay (--keep N; --keep 0 keeps every one)"
                if keep
                else f"checkpoints: every one stays in {folder} (--keep 0)"
            )
        if keep:  # rank 0 prunes; its failure is every rank's, at once (runtime.rank_agreement)
            on_rank0(
                lambda: checkpoint.prune(folder, keep=keep),
                fail=lambda why: checkpoint.CheckpointError(
                    [
                        Diagnostic(
                            rule="checkpoint",
                            loc=SourceLoc(path=folder),
                            message=f"removing checkpoints beyond --keep {keep} failed: {why}",
                            fix="check the --save folder's permissions; the new checkpoint is complete",
                        )
                    ]
                ),
            )
        log(f"saved checkpoint {path}")

    def save(self) -> None:
        self.save_checkpoint()
        if self.cfg.checkpoint.export_hf:
            adapters = self.cfg.checkpoint.export_adapters
            self.policy.export_hf(self.cfg.checkpoint.export_hf, adapters_only=adapters)
            what = "the LoRA adapters (a PEFT folder)" if adapters else "Hugging Face weights"
            log(f"exported {what} to {self.cfg.checkpoint.export_hf}")


def _data_problem(cfg: RunConfig, message: str) -> PlanError:
    """A batch the engine refused (``BatchError``), as the diagnostic of the --data it came from."""
    return PlanError(
        [
            Diagnostic(
                rule="data",
                loc=SourceLoc(path=cfg.data.path or cfg.model.plan),
                message=message,
                fix="check --data, --micro-batch-size and --max-tokens",
            )
        ]
    )


EXIT_DIAGNOSED = 4  # a worker stopped on a problem it reported as a diagnostic (result file)


def _non_finite(step: int, exc: NonFiniteError, cfg: RunConfig) -> PlanError:
    """The problem of a step whose loss or gradient norm is not finite, naming the first
    parameter (in model order, over all ranks) whose gradient holds a NaN or inf."""
    where = f"; first non-finite gradient: {exc.parameter}" if exc.parameter else ""
    kept = "the optimizer did not step; " + (
        "no checkpoint was written by this run" if cfg.checkpoint.save else "nothing saved"
    )
    return PlanError(
        [
            Diagnostic(
                rule="non-finite",
                loc=SourceLoc(path=cfg.model.plan),
                message=f"step {step}: loss {exc.loss:.6g}, gradient norm {exc.grad_norm:.6g}{where}; {kept}",
                fix="check the model config (eps, scales) and the data; lower --lr; resume from the last checkpoint",
            )
        ]
    )


def _lock_save_folder(cfg: RunConfig) -> checkpoint.FolderLock | None:
    """Rank 0 holds the --save folder's lock for the whole run; every rank learns the verdict."""
    if not cfg.checkpoint.save:
        return None
    lock = None
    problem: list[list[Diagnostic] | None] = [None]
    if dist.get_rank() == 0:
        try:
            lock = checkpoint.FolderLock(cfg.checkpoint.save).acquire()
        except checkpoint.CheckpointError as exc:
            problem = [exc.diagnostics]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise checkpoint.CheckpointError(problem[0])
    return lock


def train(cfg: RunConfig) -> dict[str, Any]:
    job = setup_job(cfg)
    policy = job_policy(cfg, job)
    log(
        f"plancc apply: {job.plan.name} on {job.model_name} | world {dist.get_world_size()} "
        f"{job.layout.describe()} | {job.device} | weights: {policy.weight_source}{lora_note(policy)}"
    )
    log(data_note(cfg, job.dataset))
    log(memory_note(cfg, job, policy))
    log(optimizer_note(cfg, policy))
    if job.eval_rows is not None:
        every = f"every {cfg.eval.eval_every} steps and " if cfg.eval.eval_every else ""
        rows = job.eval_rows
        log(f"eval: {rows.path}, {len(rows.sequences)} rows, {every}at the end (the loss counts as training's does)")
    warnings = _weight_warnings(policy.model, cfg, job)
    trainer = _Trainer(cfg=cfg, job=job, policy=policy)
    lock = _lock_save_folder(cfg)
    trainer.resume()
    t_start = time.perf_counter()
    with diagnosed("training", fallback=SourceLoc(path=cfg.model.plan)):
        history = trainer.run()
    elapsed = time.perf_counter() - t_start
    if not trainer.interrupted:  # a stop request ends the run now: the periodic checkpoints stand
        trainer.save()
    if lock is not None:
        lock.release()
    summary: dict[str, Any] = {
        "warnings": warnings,
        "steps": len(history),
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "seconds": elapsed,
        "history": history,
    }
    if trainer.interrupted:
        summary["interrupted"] = {
            "signal": signal.Signals(trainer.interrupted).name,
            "step": trainer.done,
            # this run's newest checkpoint, or an earlier run's in the same folder
            "last_checkpoint": str(path) if (path := checkpoint.newest(cfg.checkpoint.save)) else None,
        }
        return summary
    steps = f"{len(history)} step{'' if len(history) == 1 else 's'}"
    log(
        f"summary: {steps} in {elapsed:.1f}s, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}"
        if history
        else "summary: no steps"
    )
    return summary


def run_verify(cfg: RunConfig) -> dict[str, Any]:
    job = setup_job(cfg)
    # a resumed run's next batches are those after its checkpoint's step: the step found once, and
    # handed on (a newer checkpoint appearing meanwhile must not be the one verify loads)
    step_dir = checkpoint.agreed_find(cfg.checkpoint.resume) if cfg.checkpoint.resume else None
    start = checkpoint.read_info(step_dir).step if step_dir is not None else 0
    batches = list(global_batches(cfg, job.dataset, job.config.vocab_size, start, cfg.training.steps + 1))
    with diagnosed("verify", fallback=SourceLoc(path=cfg.model.plan)):
        report = verify_against_unsharded(
            job.plan,
            job.model_name,
            job.mesh,
            steps=cfg.training.steps,
            seed=cfg.training.seed,
            lr=cfg.optimizer.lr,
            weight_decay=cfg.optimizer.weight_decay,
            max_grad_norm=cfg.optimizer.max_grad_norm,
            batches=batches,
            device=job.device,
            micro_batch_size=cfg.data.micro_batch_size,
            max_tokens=cfg.data.max_tokens,
            pack=cfg.data.pack,
            weights=cfg.model.name if from_folder(cfg.model.name) else None,
            resume=str(step_dir) if step_dir is not None else None,
        )
    flags = torch.tensor([int(within_tolerance(report))], device=job.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    ok = bool(flags.item())
    log(f"verify {job.plan.name} on {job.model_name} ({job.layout.describe()}) against the unsharded model:")
    cutting = [
        ("--micro-batch-size", cfg.data.micro_batch_size),
        ("--max-tokens", cfg.data.max_tokens),
        ("--pack", cfg.data.pack),
    ]
    cuts = [flag if value is True else f"{flag} {value}" for flag, value in cutting if value]
    if job.layout.pp > 1:
        cuts.append("through the pipeline's stages, rows of one length a schedule step")
    log(
        f"  both from {report.weights} (the unsharded loss on the first batch {report.first_loss:.6f}); "
        f"the sharded run cut as apply cuts it ({', '.join(cuts) or 'one pass'})"
    )
    rows = report.reference_chunk_rows
    log(
        f"  the unsharded model in fp32, {rows} row{'s' if rows != 1 else ''} of the global batch at a time "
        f"(their gradients summed: one pass's, rounded apart), its AdamW moments split over the "
        f"{dist.get_world_size()} ranks"
    )
    if report.dropout_off:
        log(f"  dropout off in both models for the comparison ({', '.join(report.dropout_off)})")
    log(
        f"  logits  max |diff| {report.logits_max_abs:.3e}  relative {report.logits_max_rel:.3e}  "
        f"(tolerance {report.tolerance('logits_rel'):.1e})"
    )
    log(f"  loss    |diff| {report.loss_abs:.3e}  (tolerance {TOLERANCES['loss_abs']:.0e})")
    log(
        f"  grads   max relative diff {report.grad_max_rel:.3e} in {report.worst_grad}  "
        f"over {report.params_compared} parameters (tolerance {report.tolerance('grad_rel'):.1e}; "
        + (
            f"fp32 vs fp64 of the unsharded model: {report.grad_floor:.1e})"
            if report.floor_measured
            else "fp32 within its fixed bars: no fp64 look)"
            if report.grad_max_rel <= TOLERANCES["grad_rel"] and report.logits_max_rel <= TOLERANCES["logits_rel"]
            else "the model does not run in fp64: the fixed bars apply)"
        )
    )
    if report.grad_exact_rel > 0:
        log(
            f"  grads   against fp64: sharded {report.grad_exact_rel:.3e}, unsharded fp32 {report.grad_floor:.3e} "
            f"(the sharded model may be {EXACT_FACTOR:g}x as far from exact as fp32 where fp32 misses its bar)"
        )
    for i, d in enumerate(report.step_loss_abs, start=1):
        log(f"  loss after step {i}: |diff| {d:.3e}")
    log(f"  replicated parameters identical across tp ranks: {report.replicas_identical}")
    if report.tied_identical is not None:
        log(f"  tied weights identical on the first and the last pipeline stage: {report.tied_identical}")
    log("verify: OK" if ok else "verify: FAILED (beyond tolerance)")
    return {"ok": ok, **report.as_dict()}


Row = dict[str, list[float]]  # {"logprobs": [...]} and, with --entropy, {"entropy": [...]}


def _gather_rows(results: dict[int, Row], worst: float, device: str) -> tuple[dict[int, Row], float]:
    """Every rank's rows and the worst difference over all ranks."""
    gathered: list[dict[int, Row] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    worst_t = torch.tensor([worst], device=device)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    merged: dict[int, Row] = {}
    for part in gathered:
        merged.update(part or {})
    return merged, worst_t.item()


def _logprobs_of(cfg: RunConfig, job: Job, policy: Policy, reference: nn.Module | None) -> tuple[dict[int, Row], float]:
    """This rank's rows of log-probs (and entropy) by ``Policy.logprobs``, and the worst
    difference from the unsharded ``reference`` when there is one. The data goes in global
    batches of --batch-size rows per dp rank, each rank its ``slice_of``; the last one is filled
    up to a multiple of dp with copies of its first row, whose results are dropped."""
    sequences = job.dataset.sequences if job.dataset else ()
    dp, results, worst = policy.dp_size, {}, 0.0
    for lo in range(0, len(sequences), cfg.data.batch_size * dp):
        rows = list(range(lo, min(lo + cfg.data.batch_size * dp, len(sequences))))
        filled = rows + rows[:1] * (-len(rows) % dp)
        part = policy.slice_of(len(filled))
        mine, real = filled[part], [i < len(rows) for i in range(len(filled))][part]
        seqs = [sequences[i] for i in mine]
        ids, mask = (t.to(job.device) for t in padded_rows(seqs))
        lp, ent = _evaluated(policy, cfg, {"input_ids": ids, "attention_mask": mask})
        if reference is not None:
            worst = max(worst, logprobs_difference(reference, ids, mask, lp, temperature=cfg.logprobs.temperature))
        for r, (i, kept) in enumerate(zip(mine, real, strict=True)):
            if not kept:  # a filler row: computed so every dp rank runs the same passes, not kept
                continue
            results[i] = {"logprobs": lp[r, : len(seqs[r])].tolist()}
            if ent is not None:
                results[i]["entropy"] = ent[r, : len(seqs[r])].tolist()
    return results, worst


def _evaluated(
    policy: Policy, cfg: RunConfig, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Policy.logprobs`` of one batch as --batch-size, --pack, --temperature, --entropy say."""
    options: dict[str, Any] = {
        "micro_batch_size": cfg.data.batch_size,
        "pack": cfg.data.pack,
        "temperature": cfg.logprobs.temperature,
    }
    try:
        if cfg.logprobs.entropy:
            lp, ent = policy.logprobs(batch, entropy=True, **options)
            return lp, ent
        return policy.logprobs(batch, **options), None  # type: ignore[return-value]
    except BatchError as exc:
        raise _data_problem(cfg, str(exc)) from None


def _weight_warnings(model: nn.Module, cfg: RunConfig, job: Job) -> list[dict[str, Any]]:
    """What the loaded weights warn of (rank 0 says it on stderr now; the result carries it to
    ``--format json``)."""
    found = non_finite_weight_warning(model, cfg.model.name, job.device)
    if found is None:
        return []
    if dist.get_rank() == 0:
        print(found.format(), file=sys.stderr, flush=True)
    return [found.to_json()]


def run_logprobs(cfg: RunConfig) -> dict[str, Any]:
    """Per-token log-probs of every line of ``cfg.data.path`` (rank 0 writes ``cfg.logprobs.out``)."""
    job = setup_job(cfg)
    assert job.dataset is not None, "the CLI requires --data for logprobs"
    sequences, device = job.dataset.sequences, job.device
    policy = job_policy(cfg, job)
    source = policy.weight_source
    # log-probs of NaN weights are NaN lines with exit 0: refused, as save and export refuse them
    found = non_finite_weight_warning(policy.model, cfg.model.name, job.device)  # collective: one verdict
    if found is not None:
        refused = f"{found.message}; refused, no log-probs written"
        raise PlanError([dataclasses.replace(found, severity=Severity.ERROR, message=refused)])
    warnings: list[dict[str, Any]] = []
    reference = None
    if cfg.training.verify:
        folder = str(cfg.model.name) if from_folder(cfg.model.name) else None
        reference = unsharded_reference(job.config, seed=cfg.training.seed, device=device, folder=folder).eval()
    with diagnosed("log-probs", fallback=SourceLoc(path=cfg.model.plan)):
        results, worst = _logprobs_of(cfg, job, policy, reference)
    merged, worst = _gather_rows(results, worst, device)
    if dist.get_rank() == 0 and cfg.logprobs.out:
        with open(cfg.logprobs.out, "w") as f:
            for i in range(len(sequences)):
                f.write(json.dumps(merged[i]) + "\n")
    elif dist.get_rank() == 0 and not cfg.logging.json_output:
        for i in range(len(sequences)):  # no --out: JSONL on stdout, for a pipe
            print(json.dumps(merged[i]), flush=True)
    log(
        f"plancc logprobs: {job.plan.name} on {job.model_name} | {job.layout.describe()} | weights: {source} "
        f"| {len(merged)} sequences" + (f" -> {cfg.logprobs.out}" if cfg.logprobs.out else "")
    )
    ok = True
    if cfg.training.verify:
        ok = worst <= 1e-5
        log(
            f"verify: max |logprob diff| vs the unsharded model {worst:.3e} (tolerance 1e-05): "
            + ("OK" if ok else "FAILED")
        )
    result: dict[str, Any] = {
        "ok": ok,
        "max_abs_diff": worst if cfg.training.verify else None,
        "sequences": len(merged),
        "warnings": warnings,
    }
    if not cfg.logprobs.out and cfg.logging.json_output:  # --format json: the log-probs go into the one document
        result["logprobs"] = [merged[i]["logprobs"] for i in range(len(sequences))]
        if cfg.logprobs.entropy:
            result["entropy"] = [merged[i]["entropy"] for i in range(len(sequences))]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plancc-worker")
    parser.add_argument("--config", required=True, help="RunConfig as JSON")
    parser.add_argument("--result", help="rank 0 writes its result here as JSON")
    args = parser.parse_args(argv)
    cfg = RunConfig.from_json(args.config)
    reporting.LOG_STREAM[0] = sys.stderr if cfg.log_to_stderr else sys.stdout
    StopRequest.install()
    launcher = LauncherWatch(args.result).start()
    if cfg.training.inputs is not None:  # the peak the launcher names if the OOM killer ends this rank
        PeakRecorder(cfg.training.inputs, int(os.environ.get("RANK", "0"))).start()

    @record
    def worker() -> dict[str, Any]:
        try:
            # DTensor's shape propagation runs ops on fake tensors, which log a failure with its
            # traceback at ERROR before raising it: the raised error is reported as one diagnostic
            with quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL):
                if cfg.training.mode == "logprobs":
                    return run_logprobs(cfg)
                return run_verify(cfg) if cfg.training.verify else train(cfg)
        except PlanError as exc:  # a diagnosed problem (every rank sees it): reported, not a traceback
            return {"ok": False, "diagnostics": [d.to_json() for d in exc.diagnostics]}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    try:
        result = worker()
    except Exception as exc:  # noqa: BLE001 - record() gave the agent the error; the trace goes to a file
        launcher.exit_if_orphaned()  # a dead launcher's peers fail too: nobody is left to read a log
        log_traceback(cfg, exc)
        return EXIT_FAILED
    finally:
        launcher.exit_if_orphaned()
    assert result is not None  # record() returns what the worker returned
    if args.result and int(os.environ.get("RANK", "0")) == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    if result.get("diagnostics"):
        return EXIT_DIAGNOSED
    return 0 if result.get("ok", True) else 3


if __name__ == "__main__":
    code = main()
    # Skip interpreter finalization, as multiprocessing's workers do: after a DCP load on
    # gloo (torch 2.13) a C++ thread still joinable at exit aborts the process with
    # "terminate called without an active exception", turning a finished run into SIGABRT.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
