"""Preset skeletons: `plancc validate` checks built-in presets on a shipped record of their
module tree instead of building the transformers model. The checks must stay exactly as
strong: each shipped record is what the pinned transformers builds, and every diagnostic and
summary on the skeleton equals the one on the real model, for passing and failing plans."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources

import pytest

from plancc import check_plan, load_plan
from plancc.checks.report import validate_plan
from plancc.models import build_meta_model, load_config, presets
from plancc.skeleton import describe, load_skeleton

from .conftest import PLANS

SHIPPED = sorted(p.name for p in resources.files("plancc").joinpath("presets", "skeletons").iterdir())
PLAN_OF = {"Qwen3ForCausalLM": "qwen3.yaml", "Qwen2ForCausalLM": "qwen3.yaml", "LlamaForCausalLM": "llama.yaml",
           "Gemma3ForCausalLM": "gemma3.yaml", "Qwen3MoeForCausalLM": "qwen3_moe.yaml",
           "MixtralForCausalLM": "mixtral.yaml", "DeepseekV3ForCausalLM": "deepseek_v3.yaml",
           "GptOssForCausalLM": "gpt_oss.yaml", "DogeForCausalLM": "qwen3.yaml",
           "Phi3ForCausalLM": "phi3.yaml"}
LAYOUTS = [
    dict(tp=1),
    dict(tp=2, sequence_parallel=True, seq_len=34),  # an odd SP length: sequence-length
    dict(tp=4, dp=2, world_size=8),                  # kv heads of the tiny presets: an error there
    dict(tp=16, world_size=16),                      # heads of the published ones
    dict(tp=2, cp=2, seq_len=64),
    dict(tp=3, world_size=4),                        # mesh-sizes
]


def test_every_preset_has_a_skeleton():
    assert sorted(f"{name}.json" for name in presets()) == SHIPPED


@pytest.mark.parametrize("preset", sorted(presets()))
def test_a_shipped_skeleton_is_what_the_pinned_transformers_builds(preset):
    config = load_config(preset)
    shipped = json.loads(resources.files("plancc").joinpath("presets", "skeletons", f"{preset}.json").read_text())
    assert describe(build_meta_model(config), config) == shipped, "run `python -m plancc.skeleton` to refresh"
    _, skeleton = load_skeleton(preset)
    real = build_meta_model(config)
    assert [(n, type(m).__name__) for n, m in skeleton.named_modules()] == \
        [(n, type(m).__name__) for n, m in real.named_modules()]
    assert [(n, p.shape) for n, p in skeleton.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert [n for n, _ in skeleton.state_dict().items()] == [n for n, _ in real.state_dict().items()]


# every tiny preset and one published model of each family with a plan: each shipped tree's
# structure is pinned above, the verdicts here
@pytest.mark.parametrize("preset", [p for p in sorted(presets()) if p.startswith("tiny-")] + ["qwen3-8b", "gemma-3-1b"])
def test_validating_on_a_skeleton_reports_exactly_what_the_real_model_does(preset, write_plan):
    own = PLANS / PLAN_OF[presets()[preset].architecture]
    other = PLANS / ("llama.yaml" if own.name != "llama.yaml" else "qwen3.yaml")
    broken = write_plan(own.read_text().replace("self_attn.o_proj: rowwise\n", "self_attn.o_proj: colwise\n", 1))
    untied = write_plan(own.read_text().replace("  model.embed_tokens: embedding_rowwise\n", ""), "untied.yaml")
    _, skeleton = load_skeleton(preset)
    real = build_meta_model(load_config(preset))
    for path in (own, other, broken, untied):
        plan = load_plan(path)
        for layout in LAYOUTS:
            assert check_plan(plan, skeleton, **layout) == check_plan(plan, real, **layout), (path.name, layout)
    fast = validate_plan(own, model=preset, tp=2, sequence_parallel=True)
    assert type(fast.meta_model).__module__ == "plancc.skeleton"
    full = validate_plan(own, model=preset, tp=2, sequence_parallel=True, skeleton=False)
    assert (fast.diagnostics, fast.summary()) == (full.diagnostics, full.summary())


def test_validate_imports_no_transformers_modeling_code_and_the_dry_run_builds_the_real_model():
    """Nor torch's DTensor package (about a second of every pre-commit run): the checks reason
    with plancc's own placements; torch styles are built only for a real model."""
    code = ("import sys; from plancc.checks.report import validate_plan; r = validate_plan(sys.argv[1], tp=8); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers', 'torch.distributed.tensor')))); "
            "print(r.has_errors)")
    out = subprocess.run([sys.executable, "-c", code, str(PLANS / "qwen3.yaml")], capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out == ["[]", "False"]
    _, skeleton = load_skeleton("tiny-qwen3")
    with pytest.raises(NotImplementedError, match="skeleton"):
        skeleton.model.layers[0](None)
    report = validate_plan(PLANS / "qwen3.yaml", model="tiny-qwen3", skeleton=False)
    assert type(report.meta_model).__module__.startswith("transformers.")
