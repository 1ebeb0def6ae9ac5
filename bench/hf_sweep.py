"""Every Hugging Face decoder with a TP plan, through plancc as a new user would take it.

    python bench/hf_sweep.py                      # all, writes the table to stdout
    python bench/hf_sweep.py --only qwen3 mixtral --no-verify
    python bench/hf_sweep.py --markdown docs/models.md
    python bench/hf_sweep.py --ep --skip-tp-verify --markdown ep.md   # expert parallelism only

For each config class of the pinned transformers whose (text) config carries a
``base_model_tp_plan`` and whose model type has a causal-LM class: a tiny config (2 layers,
hidden 64, 4 heads / 2 KV heads, vocab 256, 4 experts of 2 active where it has experts) saved
to a folder, then

1. ``plancc import-hf DIR``            -> the plan, or the reason it is refused
2. ``check_plan(plan, DIR, tp=2)``     -> errors (what ``plancc validate --tp 2`` prints)
3. ``plancc apply plan --model DIR --tp 2 --steps 1 --verify`` (2 gloo processes) -> OK / FAILED
4. with ``--ep``, for plans with a ``moe_experts`` rule: the same at ``--ep 2`` (2 processes) and
   ``--ep 2 --tp 2`` (4 processes) -> OK / FAILED each
5. with ``--cp``: ``check_plan(plan, DIR, cp=2)`` and, where it accepts the layout, ``plancc apply
   plan --model DIR --cp 2 --steps 1 --verify`` -> verified / refused (the check's reason) / FAILED

One line per model type: ``imported``, ``validated``, ``verified`` or the first stage that
failed and why. Takes ~15 s per verified model on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 8,  # 4 query heads a KV head: Qwen3-8B's 32:8 (Llama 3 70B: 64:8)
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "pad_token_id": 0,  # defaults name ids of the real vocabulary
    # shorter than the 32-token sequences apply trains on: the window is exercised (and under
    # context parallelism, crosses the shard boundary)
    "sliding_window": 8,
    # mixtures of experts: few, small experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    # MLA (DeepSeek V2/V3, MiniCPM3): small ranks
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,  # a query/key head of 24 beside a value head of 16: DeepSeek-V3's 192:128
    "v_head_dim": 16,
    # DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-MoE-DSA): few, small heads
    "index_n_heads": 4,
    "index_head_dim": 16,
    # ... and fewer keys kept than the 32-token rows have: the pick binds (real: 2048 of 128k)
    "index_topk": 8,
    # Doge's dynamic mask: the same, for its kept keys (real: 2048)
    "keep_window_size": 8,
}


def candidates() -> list[str]:
    """Model types with a TP plan and a causal-LM class, in transformers' order."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in CONFIG_MAPPING:
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # configs that cannot be built with defaults
            continue
        if getattr(config, "base_model_tp_plan", None):
            found.append(model_type)
    return found


# multimodal decoders build their vision/audio towers too (Phi-4-multimodal's are ~0.8B
# parameters): one small block each; a text-only forward never runs them
TOWER = {"num_hidden_layers": 1, "num_blocks": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}


def _shrink_towers(config: object) -> None:
    from transformers import PretrainedConfig

    for name in ("vision_config", "audio_config", "speech_config"):
        tower = getattr(config, name, None)
        if isinstance(tower, PretrainedConfig):
            for key, value in TOWER.items():
                if isinstance(getattr(tower, key, None), int):
                    setattr(tower, key, value)


def _has_field(config: object, name: str) -> bool:
    """Whether the config has the field; a per-layer field (Gemma 4's head_dim) refuses to be
    read globally, and the tiny value is given to every layer."""
    try:
        return hasattr(config, name)
    except Exception as exc:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return "per-layer" in str(exc)


def tiny_config(model_type: str, folder: Path) -> str:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    defaults = AutoConfig.for_model(model_type)
    fields = {k: v for k, v in TINY.items() if _has_field(defaults, k)}
    if "qk_rope_head_dim" in fields and "head_dim" in fields:
        # multi-head latent attention rotates qk_rope_head_dim features (transformers sets
        # head_dim to it): a separate head_dim would make a config no real model has
        fields["head_dim"] = fields["qk_rope_head_dim"]
    if "kv_lora_rank" in fields and "num_key_value_heads" in fields:
        # MLA expands its latent into one key per head: real MLA configs have as many KV heads
        # as heads (DeepSeek-V3.2's attention fails with fewer, with or without plancc)
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    config = AutoConfig.for_model(model_type, **fields)
    _shrink_towers(config)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    config.save_pretrained(folder)
    return str(folder)


_FORWARD = """
import resource, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # a tiny model needs far less
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
model(input_ids=torch.randint(0, 256, (1, 16)), use_cache=False)  # as plancc runs it
"""


def _unsharded_forward_fails(folder: str) -> str:
    """Why one forward of the unsharded tiny model fails (in its own process, memory-capped), or ''."""
    proc = subprocess.run([sys.executable, "-c", _FORWARD, folder], capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}"


def _verify(plan_path: Path, spec: str, nproc: int, *layout: str) -> tuple[bool, str]:
    argv = [sys.executable, "-m", "plancc.cli", "apply", plan_path, "--model", spec, "--steps", "1", "--verify"]
    argv += ["--nproc-per-node", str(nproc), "--device", "cpu", *layout]
    proc = subprocess.run([*map(str, argv)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return True, ""
    out = (proc.stdout + proc.stderr).splitlines()
    said = [line for line in out if ": error:" in line or "verify: FAILED" in line or "max relative diff" in line]
    return False, " / ".join(said[-2:])[:300] if said else (out[-1] if out else "")[:300]


def _expert_parallel(plan_path: Path, spec: str) -> str:
    """ep=2 and ep=2 x tp=2 verified against the unsharded model, or the first failure."""
    results = []
    for nproc, layout in ((2, ("--ep", "2")), (4, ("--ep", "2", "--tp", "2"))):
        ok, why = _verify(plan_path, spec, nproc, *layout)
        name = " x ".join(f"{a[2:]}={b}" for a, b in zip(layout[::2], layout[1::2]))
        results.append(f"{name} verified" if ok else f"{name} FAILED: {why}")
    return "; ".join(results)


def _context_parallel(plan_path: Path, spec: str) -> str:
    """cp=2: refused by the checks (with their reason), verified, or FAILED with the reason."""
    import plancc
    from plancc.checks import check_plan

    errors = [d for d in check_plan(plancc.load_plan(plan_path), spec, cp=2) if d.is_error]
    if errors:
        return f"cp=2 refused: {errors[0].message[:160]} [{errors[0].rule}]"
    ok, why = _verify(plan_path, spec, 2, "--cp", "2")
    if not ok and (broken := _unsharded_forward_fails(spec)):  # nothing plancc could be blamed for
        return f"cp=2 config: the unsharded tiny model fails too: {broken[:160]}"
    return "cp=2 verified" if ok else f"cp=2 FAILED: {why}"


def sweep_one(
    model_type: str, work: Path, verify: bool, ep: bool = False, tp_verify: bool = True, cp: bool = False
) -> tuple[str, str, str]:
    stage, why, plan_path, spec = _through_validate(model_type, work)
    if stage != "validated" or not verify:
        return stage, why, ""
    if cp:
        return stage, why, _context_parallel(plan_path, spec)
    if tp_verify:
        ok, why = _verify(plan_path, spec, 2, "--tp", "2")
        stage = "verified" if ok else "verify failed"
        broken = "" if ok else _unsharded_forward_fails(spec)
        if broken:  # the tiny config itself does not run: nothing plancc could be blamed for
            return "config", f"the unsharded tiny model fails too: {broken[:200]}", ""
    moe = ep and "moe_experts" in plan_path.read_text()
    return stage, why, _expert_parallel(plan_path, spec) if moe else ""


def _through_validate(model_type: str, work: Path) -> tuple[str, str, Path, str]:
    """(stage, why, plan path, model folder) after import-hf and validate at tp=2."""
    import plancc
    from plancc.checks import check_plan
    from plancc.errors import PlanError
    from plancc.tools.import_hf import import_hf

    folder = work / model_type
    plan_path = work / f"{model_type}.yaml"
    try:
        spec = tiny_config(model_type, folder)
    except Exception as exc:
        return "config", f"{type(exc).__name__}: {str(exc)[:160]}", plan_path, ""
    try:
        text = import_hf(spec)
    except PlanError as err:
        first = err.diagnostics[0]
        # model-config: the tiny config itself (per-layer fields it did not resize), not plancc
        stage = "config" if first.rule == "model-config" else "refused"
        return stage, f"{first.message[:260]} [{first.rule}]", plan_path, spec
    except Exception as exc:
        return "import traceback", f"{type(exc).__name__}: {str(exc)[:160]}", plan_path, spec
    plan_path.write_text(text)
    try:
        errors = [d for d in check_plan(plancc.load_plan(plan_path), spec, tp=2) if d.is_error]
    except PlanError as err:
        errors = list(err.diagnostics)
    except Exception as exc:
        return "validate traceback", f"{type(exc).__name__}: {str(exc)[:160]}", plan_path, spec
    if errors:
        return "invalid", f"{errors[0].message[:200]} [{errors[0].rule}]", plan_path, spec
    return "validated", "", plan_path, spec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="model types (default: every candidate)")
    parser.add_argument("--no-verify", action="store_true", help="stop after validate")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--ep", action="store_true", help="also verify MoE plans at ep=2 and ep=2 x tp=2")
    parser.add_argument("--skip-tp-verify", action="store_true", help="with --ep: only the expert-parallel runs")
    parser.add_argument("--cp", action="store_true", help="verify at cp=2 instead of tp=2 (the cp column)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    types = args.only or candidates()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in types:
            stage, why, ep = sweep_one(
                model_type,
                Path(tmp),
                not args.no_verify,
                ep=args.ep,
                tp_verify=not args.skip_tp_verify,
                cp=args.cp,
            )
            if args.skip_tp_verify and not ep:
                continue  # an expert-parallel-only sweep lists the MoE plans only
            rows.append((model_type, stage, why, ep))
            print(f"{model_type:<28} {stage:<18} {why} {ep}", flush=True)
    counts: dict[str, int] = {}
    for _, stage, _, ep in rows:
        counts[stage] = counts.get(stage, 0) + 1
        if ep:
            kind = "cp" if args.cp else "ep"
            verdict = next((v for v in ("FAILED", "refused", "config") if f" {v}" in ep), "verified").lower()
            key = f"{kind} {verdict}"
            counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{n} {stage}" for stage, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(f"\n{len(rows)} model types: {summary}")
    if args.markdown:
        if args.cp:
            table = ["| model type | validated (tp=2) | context parallelism (cp=2, apply --verify) |", "|---|---|---|"]
            table += [f"| {t} | {s} {w.replace('|', '/')} | {e.replace('|', '/')} |" for t, s, w, e in rows]
        elif args.skip_tp_verify:
            table = ["| model type | expert parallelism (apply --verify) |", "|---|---|"]
            table += [f"| {t} | {e.replace('|', '/')} |" for t, _, _, e in rows]
        elif args.ep:
            table = ["| model type | result (tp=2) | first problem | expert parallelism |", "|---|---|---|---|"]
            table += [f"| {t} | {s} | {w.replace('|', '/')} | {e.replace('|', '/')} |" for t, s, w, e in rows]
        else:
            table = ["| model type | result | first problem |", "|---|---|---|"]
            table += [f"| {t} | {s} | {w.replace('|', '/')} |" for t, s, w, _ in rows]
        Path(args.markdown).write_text("\n".join(table) + f"\n\n{len(rows)} model types: {summary}\n")


if __name__ == "__main__":
    main()
