"""Every shipped plan, one rule changed at a time: does ``validate`` agree with the ground truth?

    python bench/plan_mutations.py                          # every plan; ground truth from the cache
    python bench/plan_mutations.py --plans qwen3 llama --truth   # run missing ground truths (launches)
    python bench/plan_mutations.py --markdown docs/measurements/plan_mutations.md

A mutation is one edit a user makes to a shipped plan (``mutations``): a ``tensor_parallel`` rule
given another style its modules accept, removed, or its ``optional`` flipped; a
``sequence_parallel`` rule the same, checked with ``--sp``. Each is judged two ways:

- ``validate``: ``validate_plan(plan, model=<the plan's tiny preset>, tp=2[, sp])`` in this
  process: refused (an error) or passed;
- the ground truth: ``plancc apply MUTATED --model <tiny> --nproc-per-node 2 --tp 2 [--sp]
  --steps 1 --verify`` with plancc's own pre-launch checks switched off (``--unchecked``, a
  shim in this file that drops the report's errors), 2 gloo processes: ``exact`` (verify OK) or
  not (a crash, or verify beyond its bars).

A *false ok* is a mutation validate passes that is not exact; a *false error* one validate
refuses that is exact. The ground truth depends only on the mutated plan, never on the checks,
so it is kept in a cache (``docs/measurements/plan_mutations.json``, keyed by the mutation) and a
later run of the checks is judged against it without a launch. ~11 s per launch on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "docs" / "measurements" / "plan_mutations.json"

TINY = {
    "qwen3": "tiny-qwen3",
    "llama": "tiny-llama",
    "gemma3": "tiny-gemma3",
    "phi3": "tiny-phi3",
    "qwen3_moe": "tiny-qwen3-moe",
    "mixtral": "tiny-mixtral",
    "deepseek_v3": "tiny-deepseek-v3",
    "gpt_oss": "tiny-gpt-oss",
}

# Each style a module kind takes without overrides it must be given (prepare_output and
# prepare_input_output need their layouts; the sequence styles are the SP overlay's).
_LINEAR = ("colwise", "colwise_rep", "rowwise", "rowwise_rep", "replicate", "packed_colwise", "packed_rowwise",
           "mla_kv_a_proj")
CANDIDATES = {
    "linear": _LINEAR,
    "linear_sp": (*_LINEAR, "colwise_seq", "rowwise_seq"),
    "embedding": ("embedding_rowwise", "colwise", "rowwise", "colwise_rep", "rowwise_rep", "replicate"),
    "embedding_sp": ("embedding_rowwise", "embedding_seq", "replicate"),
    "norm": ("qk_norm", "sequence_parallel", "replicate"),
    "rotary": ("rotary_sp", "replicate"),
    "experts": ("moe_experts", "replicate"),
    "other": ("shared_input", "gather_seq_input", "per_head_params", "prepare_input", "replicate"),
}


@dataclass(frozen=True, slots=True)
class Mutation:
    plan: str
    section: str
    glob: str
    edit: str  # "style:NAME", "removed", "optional:BOOL"
    sp: bool

    @property
    def key(self) -> str:
        return f"{self.plan}|{self.section}|{self.glob}|{self.edit}|{'sp' if self.sp else 'tp'}"

    def apply_to(self, doc: dict[str, Any]) -> dict[str, Any]:
        out = json.loads(json.dumps(doc))
        rules = out[self.section]
        value = rules[self.glob]
        if self.edit == "removed":
            del rules[self.glob]
        elif self.edit.startswith("style:"):
            style = self.edit.removeprefix("style:")
            rules[self.glob] = {**value, "style": style} if isinstance(value, dict) else style
            if isinstance(value, dict):  # overrides belong to the old style
                rules[self.glob] = {k: v for k, v in rules[self.glob].items() if k in ("style", "optional")}
        else:
            flag = self.edit == "optional:true"
            style = value["style"] if isinstance(value, dict) else value
            rules[self.glob] = {**(value if isinstance(value, dict) else {"style": style}), "optional": flag}
        return out


def _kinds(plan_path: Path, model: str) -> dict[tuple[str, str], set[str]]:
    """(section, glob) -> the module kinds it matches on ``model``."""
    from plancc.checks.report import validate_plan
    from plancc.compiler.styles import module_kind

    report = validate_plan(plan_path, model=model, tp=2, sequence_parallel=True)
    modules = dict(report.meta_model.named_modules())
    found: dict[tuple[str, str], set[str]] = {}
    for resolved in report.resolved:
        for r in resolved.rules:
            kinds = {str(module_kind(modules[n])) for n in r.modules if n in modules}
            found.setdefault((r.rule.section, r.rule.pattern), set()).update(kinds)
    return found


def mutations(plan_name: str) -> Iterator[Mutation]:
    from plancc.compiler.styles import canonical_style as get_spec

    path = ROOT / "plans" / f"{plan_name}.yaml"
    doc = yaml.safe_load(path.read_text())
    kinds = _kinds(path, TINY[plan_name])
    # the TP section's rules at --tp 2 and, where the plan has an SP overlay, at --tp 2 --sp too
    # (there the overlay decides some of their modules); the overlay's rules at --sp
    runs = [("tensor_parallel", False), ("sequence_parallel", True)]
    if doc.get("sequence_parallel"):
        runs.insert(1, ("tensor_parallel", True))
    for section, sp in runs:
        for glob, value in (doc.get(section) or {}).items():
            style = value["style"] if isinstance(value, dict) else value
            matched = kinds.get((section, glob), set())
            kind = next(iter(matched)) if len(matched) == 1 else "other"
            overlay = section == "sequence_parallel"
            options = CANDIDATES.get(f"{kind}_sp" if overlay else kind, CANDIDATES[kind] if kind in CANDIDATES else ())
            if glob == "lm_head" or glob.endswith(".lm_head"):
                options = (*options, "colwise_logits_seq" if sp else "colwise_logits")
            for option in options:
                spec = get_spec(option)
                if option == style or (matched and not all(k in spec.module_kinds for k in matched)):
                    continue
                yield Mutation(plan_name, section, glob, f"style:{option}", sp)
            yield Mutation(plan_name, section, glob, "removed", sp)
            optional = isinstance(value, dict) and value.get("optional", False)
            yield Mutation(plan_name, section, glob, f"optional:{'false' if optional else 'true'}", sp)


def write_mutated(m: Mutation, folder: Path) -> Path:
    doc = yaml.safe_load((ROOT / "plans" / f"{m.plan}.yaml").read_text())
    target = folder / f"{m.plan}.yaml"
    target.write_text(yaml.safe_dump(m.apply_to(doc), sort_keys=False))
    return target


def validate_verdict(m: Mutation, path: Path) -> dict[str, Any]:
    from plancc.checks.report import validate_plan
    from plancc.errors import PlanError

    try:
        report = validate_plan(path, model=TINY[m.plan], tp=2, sequence_parallel=m.sp)
        errors = [d for d in report.diagnostics if d.is_error]
        signature = compiled_signature(report, m.sp)
    except PlanError as exc:
        errors = [d for d in exc.diagnostics if d.is_error]
        signature = "unreadable: " + ",".join(sorted({d.rule for d in errors}))
    return {"refused": bool(errors), "errors": [f"{d.line}:{d.rule}" for d in errors], "signature": signature}


_BINDING = ("glob-no-match", "rule-conflict", "fsdp-shard-placement")


def compiled_signature(report: Any, sp: bool) -> str:
    """What the runtime would build from the mutated plan: every module's style, the FSDP units,
    the checkpointed modules (and a glob the runtime cannot bind). Mutations with one signature
    train alike (an ``optional`` flip on a glob that matches changes nothing): one launch judges them."""
    import hashlib

    resolved = report.resolved_for(sp) or report.resolved_for(False)
    if resolved is None or any(d.rule in _BINDING for d in report.diagnostics):
        return "unbound: " + ",".join(sorted({d.rule for d in report.diagnostics if d.is_error}))
    parts = sorted(f"{name}={rule.style.describe()}" for name, rule in resolved.assignments.items())
    parts += [f"unit:{u}" for u in resolved.fsdp_units] + [f"ac:{a}" for a in resolved.activation_checkpointing]
    parts += sorted(f"bind:{d.rule}:{d.message}" for d in report.diagnostics if d.rule in _BINDING)
    text = f"{report.model_name}|sp={sp}|" + "|".join(parts)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def ground_truth(m: Mutation, path: Path) -> dict[str, Any]:
    """The mutated plan trained for a step at tp2 (sp) against the unsharded model, unchecked."""
    cmd = [sys.executable, __file__, "--unchecked", "apply", str(path), "--model", TINY[m.plan]]
    cmd += ["--nproc-per-node", "2", "--tp", "2", "--steps", "1", "--verify", "--timeout", "60"]
    cmd += ["--sp"] if m.sp else []
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=path.parent)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired:
        out, rc = "timeout", -1
    exact = rc == 0 and "verify: OK" in out
    detail = next((line for line in out.splitlines() if "error:" in line), "") if not exact else ""
    return {"exact": exact, "rc": rc, "detail": detail[-300:], "seconds": round(time.perf_counter() - start, 1)}


def ground_truths(batch: list[tuple[Mutation, Path]]) -> list[dict[str, Any]] | None:
    """The ground truth of many mutations in one 2-rank launch (~2 s each, not ~11 s of start-up),
    or None where the launch itself failed (a rank hung or died): then one launch each."""
    from tests.distributed import launch
    from tests.mutation_worker import verify_unchecked

    cases = [(str(path), TINY[m.plan], m.sp) for m, path in batch]
    try:
        results = launch(verify_unchecked, 2, cases, timeout_s=600)
    except Exception:  # a case that hangs or kills a rank: fall back to a launch per case
        return None
    ranks = [results[0], results[1]]
    # exact only where both ranks found it so (a rank's crash is the case's)
    return [
        {**ranks[0][i], "exact": ranks[0][i]["exact"] and ranks[1][i]["exact"],
         "detail": ranks[0][i]["detail"] or ranks[1][i]["detail"]}
        for i in range(len(cases))
    ]


def _unchecked_cli(argv: list[str]) -> None:
    """plancc's CLI with the report's errors dropped: the launch the checks would have refused."""
    from dataclasses import replace

    import plancc.checks.report as report_module

    checked = report_module.validate_plan

    def unchecked(*args: Any, **kwargs: Any) -> Any:
        report = checked(*args, **kwargs)
        return replace(report, diagnostics=tuple(d for d in report.diagnostics if not d.is_error))

    report_module.validate_plan = unchecked
    from plancc.cli import main

    sys.argv = ["plancc", *argv]
    main()


def main() -> None:
    if sys.argv[1:2] == ["--unchecked"]:
        _unchecked_cli(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", nargs="*", default=list(TINY))
    parser.add_argument("--truth", action="store_true", help="launch the ground truth where the cache has none")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--markdown", type=Path, help="write the per-plan table here")
    parser.add_argument("--json", type=Path, help="write every mutation's verdicts here")
    parser.add_argument("--batch", type=int, default=16, help="mutations judged per 2-rank launch")
    args = parser.parse_args()
    cache: dict[str, Any] = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.truth:
            _fill_truths(args.plans, Path(tmp) / "truth", cache, args.cache, args.batch)
        for plan in args.plans:
            for i, m in enumerate(mutations(plan)):
                folder = Path(tmp) / f"{plan}-{i}"
                folder.mkdir()
                path = write_mutated(m, folder)
                verdict = validate_verdict(m, path)
                truth = cache.get(verdict["signature"])
                if verdict["signature"].startswith(("unreadable", "unbound")):
                    # the runtime loads and binds the plan as validate does: it cannot run at all
                    truth = {"exact": False, "detail": verdict["signature"]}
                row = {"key": m.key, **verdict, "exact": None if truth is None else truth["exact"]}
                if truth is not None:
                    row["truth_detail"] = truth["detail"]
                rows.append(row)
                mark = "?" if truth is None else ("exact" if truth["exact"] else "WRONG")
                tag = ""
                if truth is not None and verdict["refused"] == truth["exact"]:
                    tag = "  <-- FALSE " + ("ERROR" if verdict["refused"] else "OK")
                print(f"{m.key:80s} validate={'refused' if verdict['refused'] else 'ok':7s} truth={mark}{tag}")
                sys.stdout.flush()
    table = summarize(rows)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


def _fill_truths(plans: list[str], folder: Path, cache: dict[str, Any], cache_path: Path, size: int) -> None:
    """The ground truth of every mutation whose compiled plan the cache has not judged, in batches."""
    todo: dict[str, tuple[Mutation, Path]] = {}
    for plan in plans:
        for i, m in enumerate(mutations(plan)):
            where = folder / f"{plan}-{i}"
            where.mkdir(parents=True)
            path = write_mutated(m, where)
            signature = validate_verdict(m, path)["signature"]
            if signature not in cache and signature not in todo and not signature.startswith(("unreadable", "unbound")):
                todo[signature] = (m, path)
    items = list(todo.items())
    print(f"ground truth: {len(items)} compiled plans to judge", flush=True)
    for start in range(0, len(items), size):
        batch = items[start : start + size]
        found = ground_truths([pair for _, pair in batch])
        if found is None:
            found = [ground_truth(m, path) for _, (m, path) in batch]
        for (signature, (m, _)), truth in zip(batch, found):
            cache[signature] = {"first": m.key, **truth}
            print(f"  {m.key}: {'exact' if truth['exact'] else 'WRONG ' + truth['detail'][:120]}", flush=True)
        cache_path.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")


def summarize(rows: list[dict[str, Any]]) -> str:
    plans: dict[str, dict[str, int]] = {}
    for row in rows:
        plan = row["key"].split("|")[0]
        counts = plans.setdefault(plan, {"mutations": 0, "judged": 0, "false_ok": 0, "false_error": 0, "refused": 0})
        counts["mutations"] += 1
        counts["refused"] += row["refused"]
        if row["exact"] is None:
            continue
        counts["judged"] += 1
        counts["false_ok"] += (not row["refused"]) and not row["exact"]
        counts["false_error"] += row["refused"] and row["exact"]
    lines = [
        "| plan | mutations | with ground truth | validate refused | false ok | false error |",
        "|---|---|---|---|---|---|",
    ]
    for plan, c in plans.items():
        lines.append(
            f"| {plan} | {c['mutations']} | {c['judged']} | {c['refused']} | {c['false_ok']} | {c['false_error']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
