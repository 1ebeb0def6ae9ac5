"""Hostile and broken input, each case run as a user would run it: a diagnostic with its rule
and location, exit 1 (2 for usage), no traceback, nothing read or written outside the
folders named, and an answer within a bound generous enough for a loaded machine."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plancc
from plancc import PlanError

from .conftest import PLANS

QWEN3 = PLANS / "qwen3.yaml"
FUZZ = int(os.environ.get("PLANCC_FUZZ_EXAMPLES", "200"))
FAST = 10.0  # seconds: a plan or config case answers well within this, even on a loaded machine


def timed_cli(cli, *args):
    t0 = time.perf_counter()
    code, out, err = cli(*args)
    return code, out, err, time.perf_counter() - t0


def one_problem(err: str, rule: str) -> str:
    lines = [line for line in err.splitlines() if line.endswith(f"[{rule}]")]
    assert lines, err
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- 1: code execution on resume
class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def saved(tiny_checkpoint):
    return tiny_checkpoint[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_whose_metadata_runs_code_is_refused_and_runs_nothing(saved, tmp_path, cli):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    marker = tmp_path / "pwned"
    metadata = ck / "step-000002" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    code, out, err = cli("apply", QWEN3, "--resume", ck, "--steps", 1)
    line = one_problem(err, "checkpoint")
    assert code == 1 and str(metadata) in line and ".system" in line and "plancc apply:" not in out
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_latest_and_shard_paths_that_leave_the_folder_are_not_followed(saved, tmp_path, cli):
    import plancc.engine.checkpoint as checkpoint
    from plancc.engine.checkpoint_reader import SafeFileSystemReader

    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    (ck / "latest").write_text("../../../etc\n")
    assert checkpoint.find(ck) == ck / "step-000002"  # the pointer is ignored, the real step found
    step = ck / "step-000002"
    meta = SafeFileSystemReader(str(step)).read_metadata()
    for info in meta.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    code, _, err = cli("apply", QWEN3, "--resume", ck)
    assert code == 1 and "outside the checkpoint folder" in one_problem(err, "checkpoint")


def test_a_weight_map_that_names_files_outside_the_folder_is_refused(tmp_path, cli):
    from plancc.models import build_model, load_config

    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "hf"
    build_model(load_config("tiny-qwen3"), device="cpu").save_pretrained(folder, max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = next(iter(index["weight_map"]))
    shard = index["weight_map"][victim]
    shutil.copy(folder / shard, outside / shard)
    for target in (f"../outside/{shard}", str(outside / shard)):
        index["weight_map"][victim] = target
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        code, _, err, seconds = timed_cli(cli, "apply", QWEN3, "--model", folder)
        assert code == 1 and seconds < FAST
        line = one_problem(err, "weights")
        assert "outside the model folder" in line or "not a file of this folder" in line


# --------------------------------------------------------------------------- 3, 4: runaway plans
def test_a_billion_laughs_plan_is_answered_at_the_alias_within_a_second_or_so(write_plan, cli):
    lines = ["plancc: 1", "name: x", "architectures: [Qwen3ForCausalLM]",
             "tensor_parallel:", "  lm_head: colwise_logits", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path = write_plan("\n".join(lines) + "\n")
    assert len(path.read_bytes()) < 700  # the 480-byte attack plus a valid plan around it
    code, _, err, seconds = timed_cli(cli, "validate", path)
    line = one_problem(err, "yaml-too-large")
    assert code == 1 and seconds < FAST and line.startswith(f"{path}:")


@pytest.mark.extended  # a scale test
def test_a_plan_of_100k_rules_that_all_miss_is_answered_in_seconds(write_plan, cli):
    rules = "".join(f"  model.layers.*.nothing_{i}: colwise\n" for i in range(100_000))
    path = write_plan(f"plancc: 1\nname: big\narchitectures: [Qwen3ForCausalLM]\ntensor_parallel:\n{rules}")
    code, _, err, seconds = timed_cli(cli, "validate", path, "--model", "tiny-qwen3")
    assert code == 1 and seconds < 60  # ~4 MB of YAML; measured in seconds on this machine
    assert err.count("[glob-no-match]") == 100_000


def test_a_deep_double_star_glob_and_a_wide_style_mapping_are_cheap(write_plan, cli):
    deep = ".".join(["**"] * 400) + ".q_proj"
    # a key past YAML's 1024-character limit for plain keys is written as an explicit key (?)
    rule = f"  ? '{deep}'\n  :\n    style: colwise\n" + "".join(f"    bogus_{i}: 1\n" for i in range(20_000))
    text = QWEN3.read_text().replace("tensor_parallel:\n", "tensor_parallel:\n" + rule, 1)
    path = write_plan(text)
    code, _, err, seconds = timed_cli(cli, "validate", path, "--model", "tiny-qwen3")
    assert code == 1 and seconds < 30 and "Traceback" not in err
    assert "[unknown-key]" in err and "[yaml-syntax]" not in err
    units = write_plan(QWEN3.read_text().replace("units: [model.embed_tokens, model.layers.*]", f"units: ['{deep}']"))
    code, _, err, seconds = timed_cli(cli, "validate", units, "--model", "qwen3-8b")
    assert code == 1 and seconds < 30 and "Traceback" not in err
    assert "[invalid-glob]" in err


# --------------------------------------------------------------------------- 5: plan values
def test_a_5000_digit_integer_is_a_diagnostic_at_the_value(write_plan, cli):
    path = write_plan(QWEN3.read_text().replace("plancc: 1", "plancc: " + "9" * 5000))
    code, _, err = cli("validate", path)
    assert code == 1 and one_problem(err, "yaml-value").startswith(f"{path}:3:9:")


# --------------------------------------------------------------------------- 6: configs
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("change,expected", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_hidden_layers": -1}, "num_hidden_layers is -1"),
    ({"intermediate_size": 0}, "intermediate_size is 0"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": 66}, "hidden size (66) is not a multiple"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"vocab_size": 10**9}, "vocab_size is 1000000000"),
    ({"model_type": "no-such-model"}, "transformers refuses this config"),
    ({"pad_token_id": 300}, "pad_token_id 300 is outside the vocabulary [0, 256)"),
    ({"hidden_act": "no-such-activation"}, "transformers cannot build LlamaForCausalLM from this config: KeyError"),
])
def test_a_config_no_model_can_be_built_from_is_a_diagnostic_naming_the_field(tmp_path, cli, change, expected):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, **change}))
    code, _, err, seconds = timed_cli(cli, "validate", PLANS / "llama.yaml", "--model", path)
    line = one_problem(err, "model-config")
    assert code == 1 and seconds < FAST and line.startswith(f"{path}: error:") and expected in line


def test_per_layer_sizes_are_sizes_too():
    """Gemma3n's intermediate_size is a list, one size per layer."""
    from transformers import AutoConfig

    from plancc.models import check_config

    config = AutoConfig.for_model("gemma3n_text")
    assert isinstance(config.intermediate_size, list) and check_config(config) is config


def test_fields_transformers_keeps_per_layer_are_read_per_layer(tmp_path, cli):
    """Gemma 4 keeps head_dim per layer (its full-attention layers' differ) and refuses a global
    read of it; import-hf and validate read each layer's value instead of ending in a traceback,
    and a head count is checked on every layer."""
    from transformers import AutoConfig

    from plancc.models import check_config, config_field, field_values

    config = AutoConfig.for_model("gemma4_text", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    config.architectures = ["Gemma4ForCausalLM"]
    assert len(field_values(config, "head_dim")) == 2 and check_config(config) is config
    assert config_field(config, "num_attention_heads") == 4
    config.save_pretrained(tmp_path)
    code, plan, err = cli("import-hf", tmp_path)
    assert code == 0 and "Traceback" not in err, err
    (tmp_path / "plan.yaml").write_text(plan)
    code, out, err = cli("validate", tmp_path / "plan.yaml", "--model", tmp_path, "--tp", "2")
    assert code == 0 and "Traceback" not in err, out + err
    code, out, err = cli("validate", tmp_path / "plan.yaml", "--model", tmp_path, "--tp", "4")
    assert code == 1 and "does not divide num_key_value_heads=2" in out + err


def test_a_config_transformers_itself_writes_with_infinity_is_read(tmp_path, cli):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "rope_scaling": None, "max_position_embeddings": 512,
                                "rms_norm_eps": {"__float__": "Infinity"}}))
    code, out, err = cli("validate", PLANS / "llama.yaml", "--model", path)
    assert code == 0 and "Traceback" not in err, err


# --------------------------------------------------------------------------- 7: weights
def _folder(tmp_path: Path) -> Path:
    from plancc.models import build_model, load_config

    folder = tmp_path / "hf"
    build_model(load_config("tiny-qwen3"), device="cpu").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("damage,expected", [
    ("truncate", "truncated or damaged"),
    ("garbage", "not a safetensors file"),
    ("empty", "too short for a safetensors header"),
    ("huge-header", "the header claims"),
    ("missing-shard", "does not exist"),
    ("index-not-json", "the index is not readable JSON"),
    ("index-no-map", "the index has no 'weight_map' object"),
])
def test_a_broken_weights_folder_is_named_before_any_process_starts(tmp_path, cli, damage, expected):
    folder = _folder(tmp_path)
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "garbage":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!" + b"x" * 64)
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "huge-header":
        weights.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    else:
        shutil.rmtree(folder)
        from plancc.models import build_model, load_config

        build_model(load_config("tiny-qwen3"), device="cpu").save_pretrained(folder, max_shard_size="100KB")
        index = folder / "model.safetensors.index.json"
        if damage == "missing-shard":
            next(folder.glob("model-00001-*.safetensors")).unlink()
        elif damage == "index-not-json":
            index.write_text("{weight_map: ")
        else:
            index.write_text(json.dumps({"metadata": {}}))
    code, out, err, seconds = timed_cli(cli, "apply", QWEN3, "--model", folder, "--steps", 1)
    line = one_problem(err, "weights")
    assert code == 1 and seconds < FAST and expected in line and "plancc apply:" not in out


# --------------------------------------------------------------------------- 8: data
@pytest.mark.parametrize("line,expected", [
    ('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"input_ids": [1, 2], "id": ' + "7" * 5000 + "}", "not readable as JSON"),
])
def test_hostile_data_lines_are_diagnostics_at_the_line(tmp_path, cli, line, expected):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n' + line + "\n")
    code, _, err, seconds = timed_cli(cli, "apply", QWEN3, "--data", data)
    assert code == 1 and seconds < FAST
    assert one_problem(err, "data-json").startswith(f"{data}:2:1:") and expected in err


def test_a_line_longer_than_the_model_takes_is_named_before_launch(tmp_path, cli):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [' + ", ".join(["7"] * 100_000) + "]}\n")
    code, _, err = cli("logprobs", QWEN3, "--data", data)
    line = one_problem(err, "data-too-long")
    assert code == 1 and line.startswith(f"{data}:2:1:") and "100000 tokens" in line and "512" in line


# --------------------------------------------------------------------------- 9: outputs
def test_outputs_that_cannot_be_written_are_refused_before_launch(tmp_path, cli):
    existing = tmp_path / "file.txt"
    existing.write_text("keep")
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    cases = [
        (("apply", QWEN3, "--save", existing), "checkpoint", "existing file"),
        (("apply", QWEN3, "--save", "/proc/plancc-ck"), "checkpoint", "cannot write checkpoints here"),
        (("logprobs", QWEN3, "--data", data, "--out", tmp_path / "no" / "such" / "dir" / "o.jsonl"), "output",
         "does not exist"),
        (("logprobs", QWEN3, "--data", data, "--out", tmp_path), "output", "is a folder"),
    ]
    for args, rule, expected in cases:
        code, out, err, seconds = timed_cli(cli, *args)
        assert code == 1 and seconds < FAST and expected in one_problem(err, rule), err
        assert "plancc" not in out.split("\n")[0] or "plancc apply:" not in out
    assert existing.read_text() == "keep"


# --------------------------------------------------------------------------- fuzzing the new shapes
fuzz_settings = settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def hostile_plans(draw) -> str:
    """Plan text with aliases, deep nesting, huge numbers and many rules mixed in."""
    kind = draw(st.sampled_from(["alias", "nesting", "number", "rules", "merge"]))
    base = QWEN3.read_text()
    if kind == "alias":
        depth, width = draw(st.integers(1, 12)), draw(st.integers(1, 12))
        lines = [f"x0: &x0 [{', '.join(['q'] * width)}]"]
        lines += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * width)}]" for i in range(1, depth)]
        at = draw(st.sampled_from(["top", "units"]))
        if at == "units":
            return base.replace("units: [model.embed_tokens, model.layers.*]", f"units: *x{depth - 1}") + "\n".join(lines) + "\n"
        return base + "\n".join(lines) + "\n"
    if kind == "nesting":
        depth = draw(st.integers(10, 3000))
        return base.replace("units: [model.embed_tokens, model.layers.*]", "units: " + "[" * depth + "]" * depth)
    if kind == "number":
        digits = draw(st.integers(1, 20_000))
        key = draw(st.sampled_from(["plancc: ", "  reshard_after_forward: ", "name: "]))
        return base.replace(key, key + "9" * digits + " #", 1)
    if kind == "merge":
        return base.replace("tensor_parallel:\n", "tensor_parallel:\n  <<: " + draw(st.sampled_from(
            ["{lm_head: colwise}", "[{a: b}, {c: d}]", "*nope", "7", "{<<: {x: y}}"])) + "\n", 1)
    count = draw(st.integers(1, 3000))
    pattern = draw(st.sampled_from(["model.layers.*.x{}", "**.y{}", "model.{}", "a.b.c.d.e.f{}"]))
    rules = "".join(f"  {pattern.format(i)}: colwise\n" for i in range(count))
    return base.replace("tensor_parallel:\n", "tensor_parallel:\n" + rules, 1)


@fuzz_settings
@given(hostile_plans())
def test_fuzz_hostile_plans_give_only_diagnostics_quickly(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("hostile") / "plan.yaml"
    path.write_text(text)
    t0 = time.perf_counter()
    try:
        plancc.load_plan(path)
    except PlanError as exc:
        assert exc.diagnostics and all(d.rule and d.message for d in exc.diagnostics)
    assert time.perf_counter() - t0 < 30  # a hang check, with room for a loaded machine


def test_yaml_round_trip_of_a_plan_with_merge_keys_stays_a_plan(tmp_path):
    doc = yaml.safe_load(QWEN3.read_text())
    path = tmp_path / "p.yaml"
    path.write_text("common: &c\n  lm_head: colwise_logits\n" + yaml.safe_dump(doc).replace(
        "tensor_parallel:\n", "tensor_parallel:\n  <<: *c\n", 1))
    with pytest.raises(PlanError) as info:  # 'common' is not a plan key; the merge itself is fine
        plancc.load_plan(path)
    assert [d.rule for d in info.value.diagnostics] == ["unknown-key"]


@pytest.mark.extended  # a scale test
def test_double_star_globs_on_a_1000_layer_model_resolve_in_seconds(tmp_path, write_plan, cli):
    from plancc.models import presets

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**presets()["tiny-qwen3"].config, "num_hidden_layers": 1000}))
    stars = ".".join(["**"] * 12)
    path = write_plan(QWEN3.read_text().replace("tensor_parallel:\n", f"tensor_parallel:\n  '{stars}.nothing': colwise\n"
                                                f"  'model.{stars}.q_proj.**': colwise\n", 1))
    code, _, err, seconds = timed_cli(cli, "validate", path, "--model", config, "--tp", 2)
    assert code == 1 and seconds < 60 and "Traceback" not in err  # was 198 s before the tree walk
    assert "[glob-no-match]" in err
