"""Model configurations and models without weights.

Presets ship inside the package (users have no ``../shared``): the real published configs of
a few model families, and tiny configs of the same architectures for quick runs and tests.
``--model`` also takes a Hugging Face model folder or a ``config.json`` path.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

from .errors import Diagnostic, PlanError, SourceLoc, closest, quiet_logger

if TYPE_CHECKING:  # transformers is imported where a config or model is built
    from transformers import PretrainedConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    name: str
    architecture: str
    summary: str
    config: dict[str, Any]


def _tiny(model_type: str, architecture: str, **extra: Any) -> dict[str, Any]:
    # 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256: every size divides tp=2 and 4 except
    # kv heads at tp=4, which is the point of a tiny preset that still exercises the checks.
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        **extra,
    }


_TINY: tuple[Preset, ...] = (
    Preset(
        name="tiny-qwen3",
        architecture="Qwen3ForCausalLM",
        summary="2-layer Qwen3, untied",
        config=_tiny("qwen3", "Qwen3ForCausalLM"),
    ),
    Preset(
        name="tiny-qwen3-tied",
        architecture="Qwen3ForCausalLM",
        summary="2-layer Qwen3, tied embeddings",
        config=_tiny("qwen3", "Qwen3ForCausalLM", tie_word_embeddings=True),
    ),
    Preset(
        name="tiny-qwen2",
        architecture="Qwen2ForCausalLM",
        summary="2-layer Qwen2 (q/k/v bias, no q/k norm)",
        config=_tiny("qwen2", "Qwen2ForCausalLM"),
    ),
    Preset(
        name="tiny-llama",
        architecture="LlamaForCausalLM",
        summary="2-layer Llama, untied",
        config=_tiny("llama", "LlamaForCausalLM"),
    ),
    Preset(
        name="tiny-llama-tied",
        architecture="LlamaForCausalLM",
        summary="2-layer Llama, tied embeddings",
        config=_tiny("llama", "LlamaForCausalLM", tie_word_embeddings=True),
    ),
    Preset(
        name="tiny-gemma3",
        architecture="Gemma3ForCausalLM",
        summary="2-layer Gemma3 text, tied embeddings",
        config=_tiny(
            "gemma3_text",
            "Gemma3ForCausalLM",
            tie_word_embeddings=True,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # mixtures of experts: 4 experts of 2 active (whole experts split evenly over tp=2 and 4)
    Preset(
        name="tiny-qwen3-moe",
        architecture="Qwen3MoeForCausalLM",
        summary="2-layer Qwen3-MoE, 4 experts, 2 active",
        config=_tiny(
            "qwen3_moe", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        ),
    ),
    Preset(
        name="tiny-mixtral",
        architecture="MixtralForCausalLM",
        summary="2-layer Mixtral, 4 experts, 2 active",
        config=_tiny("mixtral", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    ),
    Preset(
        name="tiny-deepseek-v3",
        architecture="DeepseekV3ForCausalLM",
        summary="2-layer DeepSeek-V3 (MLA; a dense layer, then 4 routed experts + 1 shared)",
        config=_tiny(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            head_dim=64,
            num_key_value_heads=4,  # MLA: a key and value per head (DeepSeek-V3's 128 of 128)
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=64,  # DeepSeek-V3's, so the shipped plan's rope_dim fits
            qk_nope_head_dim=8,
            v_head_dim=16,
            rope_interleave=True,
        ),
    ),
    Preset(
        name="tiny-gpt-oss",
        architecture="GptOssForCausalLM",
        summary="2-layer gpt-oss (biased experts, attention sinks), 4 experts, 2 active",
        config=_tiny(
            "gpt_oss",
            "GptOssForCausalLM",
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    Preset(
        name="tiny-phi3",
        architecture="Phi3ForCausalLM",
        summary="2-layer Phi-3 (fused qkv_proj and gate_up_proj)",
        config=_tiny("phi3", "Phi3ForCausalLM", pad_token_id=0),
    ),
    Preset(
        name="tiny-doge",
        architecture="DogeForCausalLM",
        summary="2-layer Doge (a per-head dynamic mask made by dt_proj, a learned A per KV head)",
        config=_tiny("doge", "DogeForCausalLM", is_moe=False),
    ),
)


@cache
def presets() -> dict[str, Preset]:
    found = {p.name: p for p in _TINY}
    folder = resources.files("plancc").joinpath("presets")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            config = json.loads(entry.read_text())
            name = entry.name.removesuffix(".json")
            arch = config["architectures"][0]
            found[name] = Preset(
                name=name, architecture=arch, summary=f"published {name} config (no weights)", config=config
            )
    return found


# The preset `plancc validate` uses when --model is not given: a real published config of
# the plan's first architecture that has one, so checks run against real head counts.
_DEFAULT_FOR_ARCHITECTURE = {
    "Qwen3ForCausalLM": "qwen3-8b",
    "Qwen2ForCausalLM": "qwen2.5-7b",
    "LlamaForCausalLM": "llama-3.1-8b",
    "Gemma3ForCausalLM": "gemma-3-1b",
    "Qwen3MoeForCausalLM": "qwen3-30b-a3b",
    "MixtralForCausalLM": "mixtral-8x7b",
    "DeepseekV3ForCausalLM": "deepseek-v3",
    "GptOssForCausalLM": "gpt-oss-120b",
    "Phi3ForCausalLM": "phi-3-mini-4k",
}


def default_preset(architectures: tuple[str, ...], *, tiny: bool = False) -> str | None:
    for arch in architectures:
        if tiny:
            for p in _TINY:
                if p.architecture == arch:
                    return p.name
        elif arch in _DEFAULT_FOR_ARCHITECTURE:
            return _DEFAULT_FOR_ARCHITECTURE[arch]
    return None


class ModelSpecError(PlanError):
    """--model names nothing we can load: a usage error (exit 2), not a plan problem."""


def _model_error(model: str, message: str, fix: str) -> ModelSpecError:
    return ModelSpecError([Diagnostic(rule="unknown-model", loc=SourceLoc(path=model), message=message, fix=fix)])


# Config fields with which a causal LM transforms the lm_head's output before returning it
# (Gemma 2's soft-capping, Cohere's and Granite's scales): plancc's fused log-prob evaluator
# applies the lm_head itself and would skip them, so such models take the logits path -- what the
# runtime does and the checks must know (a split lm_head is fine where only logits are read).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def transforms_logits(config: Any) -> bool:
    """Whether the (text) config transforms the lm_head's output (``LOGIT_TRANSFORMS``)."""
    get = getattr(config, "get_text_config", None)
    text = get() if callable(get) else config
    return any(getattr(text, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS)


def load_config(model: str | Path | Any) -> PretrainedConfig:
    """A ``PretrainedConfig`` from a preset name, a model folder, a config.json, or a config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    text = str(model)
    if text in presets():
        data = dict(presets()[text].config)
        return AutoConfig.for_model(data.pop("model_type"), **data)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return check_config(_read_config_file(path), str(path))
    near = closest(text, presets())
    if _HUB_ID.fullmatch(text):  # Qwen/Qwen3-0.6B: a hub id, not a path here
        preset = closest(text.split("/")[1].lower(), presets(), n=1) or closest(text.lower(), presets(), n=1)
        other = (
            f", or --model {preset[0]} for its published config with random weights (nothing trained)" if preset else ""
        )
        raise _model_error(
            text,
            "a Hugging Face Hub id: plancc loads no weights from the hub",
            f"download it first (huggingface-cli download {text} --local-dir DIR) and pass --model DIR{other}",
        )
    raise _model_error(
        text,
        "not a preset, a model folder or a config.json",
        (f"did you mean {near[0]!r}? " if near else "") + "see `plancc models` for presets",
    )


# owner/name, as the hub spells a repository (a relative path of two parts that does not exist)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class ConfigError(PlanError):
    """A model config that transformers refuses or that no model can be built from (exit 1)."""


def _config_problem(path: str, message: str, fix: str) -> Diagnostic:
    return Diagnostic(rule="model-config", loc=SourceLoc(path=path), message=message, fix=fix)


def _config_error(path: str, message: str, fix: str) -> ConfigError:
    return ConfigError([_config_problem(path, message, fix)])


def _read_config_file(path: Path) -> PretrainedConfig:
    """A config.json read the way transformers reads it (its JSON encodings, such as
    ``{"__float__": "Infinity"}``, and its own validation), every refusal a diagnostic."""
    from transformers import AutoConfig

    try:
        head = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise _config_error(
            str(path), f"cannot read the model config: {str(exc)[:200]}", "pass a valid config.json"
        ) from None
    if not isinstance(head, dict) or "model_type" not in head:
        raise _config_error(str(path), "config.json has no 'model_type'", "pass a Hugging Face config.json")
    raw = head.get("text_config") if isinstance(head.get("text_config"), dict) else head
    problems = _size_problems(raw, str(path))
    if problems:  # before transformers sees them: it divides by some of these sizes
        raise ConfigError(problems)
    try:
        with warnings.catch_warnings(), quiet_logger("transformers"):  # what it refuses, it raises
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # transformers raises ValueError, KeyError, TypeError and its strict-dataclass errors
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = " ".join(lines[:2])[:300] if lines else type(exc).__name__
        raise _config_error(
            str(path),
            f"transformers refuses this config: {first}",
            "compare the field it names with a config saved by the pinned transformers release",
        ) from None


# Sizes a decoder config must hold as positive integers, and the largest each may take
# before building even a meta model stops making sense (a vocabulary of 10^9 rows is a typo).
_SIZES = {
    "vocab_size": 10**8,
    "hidden_size": 10**6,
    "num_hidden_layers": 10**4,
    "num_attention_heads": 10**4,
    "num_key_value_heads": 10**4,
    "intermediate_size": 10**7,
    "head_dim": 10**5,
}


def config_field(config: Any, name: str) -> Any:
    """A config field as plancc reads it: the value, None when absent, or the list of the
    layers' values when transformers keeps it per layer and they differ (Gemma 4's head_dim,
    dots3's head counts). Such a field refuses to be read globally
    (``AmbiguousGlobalPerLayerAttributeError``); its value is then the same for every layer, or
    each layer's."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' per-layer attribute error
        layers = getattr(config, "per_layer_config", None) or ()
        values = list(dict.fromkeys(getattr(layer, name, None) for layer in layers))
        return values[0] if len(values) == 1 else values or None


def field_values(config: Any, name: str) -> list[Any]:
    """Every value a config field takes (one per distinct layer value; none when absent)."""
    value = config_field(config, name)
    return [] if value is None else value if isinstance(value, list) else [value]


def _size_problems(fields: Any, path: str) -> list[Diagnostic]:
    """Sizes that are not integers in range, from a config or the raw JSON of one."""
    problems = []
    for field, limit in _SIZES.items():
        value = fields.get(field) if isinstance(fields, dict) else config_field(fields, field)
        if value is None:
            continue
        # per-layer sizes (Gemma3n's intermediate_size) are lists of such integers
        values = value if isinstance(value, list) and value else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= limit for v in values):
            problems.append(
                _config_problem(
                    path,
                    f"{field} is {value!r}; it must be an integer from 1 to {limit} (or a list of them)",
                    f"correct {field} in the config",
                )
            )
    return problems


def _rope_thetas(config: Any) -> list[Any]:
    """Every RoPE base a config holds: transformers 5 keeps it in ``rope_parameters``, one
    mapping, or one per attention type (Gemma 3's sliding and full layers)."""
    params = getattr(config, "rope_parameters", None)
    found = [getattr(config, "rope_theta", None)] if "rope_theta" in getattr(config, "__dict__", {}) else []
    if isinstance(params, dict):
        inner = [v for v in params.values() if isinstance(v, dict)]
        found += [p.get("rope_theta") for p in inner or [params]]
    return [t for t in found if t is not None]


def _range_problems(config: Any, path: str) -> list[Diagnostic]:
    """Values transformers takes without a word that break the model: a window of no tokens
    (every query masked), a RoPE base <= 0 (NaN angles), no positions at all."""
    problems = []

    def positive(name: str, values: list[Any], what: str) -> None:
        bad = [
            v
            for v in values
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        ]
        if bad:
            problems.append(
                _config_problem(path, f"{name} is {bad[0]!r}; {what}", f"correct {name} in the config (a number > 0)")
            )

    positive("max_position_embeddings", field_values(config, "max_position_embeddings"), "the model takes no position")
    if getattr(config, "use_sliding_window", True) is not False:  # Qwen2-MoE's default: 0, switched off
        positive("sliding_window", field_values(config, "sliding_window"), "a window of no tokens masks every query")
    positive("rope_theta", _rope_thetas(config), "rotary angles need a base > 0")
    return problems


def check_config(config: PretrainedConfig, path: str = "<config>") -> PretrainedConfig:
    """Refuse a config no model can be built from, naming the field: zero, negative, huge or
    non-integer sizes, and heads that do not split the hidden size. Returns the config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = _size_problems(text, path)
    heads, hidden = config_field(text, "num_attention_heads"), config_field(text, "hidden_size")
    head_dim = config_field(text, "head_dim")
    # transformers derives head_dim = hidden // heads when the file gives none: a remainder is lost
    derived = head_dim is None or (isinstance(hidden, int) and isinstance(heads, int) and head_dim == hidden // heads)
    if not problems and isinstance(heads, int) and isinstance(hidden, int) and derived and hidden % heads:
        problems.append(
            _config_problem(
                path,
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim is given",
                "set head_dim, or a hidden size heads divide",
            )
        )
    pad, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
    if not problems and isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        problems.append(
            _config_problem(
                path,
                f"pad_token_id {pad} is outside the vocabulary [0, {vocab})",
                "set pad_token_id to a token id below vocab_size, or null",
            )
        )
    problems += _range_problems(text, path)
    kv = config_field(text, "num_key_value_heads")
    if not problems and isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        problems.append(
            _config_problem(
                path,
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                "correct num_key_value_heads (grouped-query attention shares whole groups)",
            )
        )
    if problems:
        raise ConfigError(problems)
    return config


def architecture_of(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else type(config).__name__.replace("Config", "ForCausalLM")


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device but buffers for real.

    Buffers such as rotary ``inv_freq`` or Gemma's ``embed_scale`` are not persistent (no
    checkpoint holds them) and are computed in ``__init__``; a model built wholly on meta
    would lose them at ``to_empty``. They are tiny, so they are built on the CPU and
    ``materialize`` carries them over.
    """

    def on_meta(_module: nn.Module, _name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None  # registered as given
        return type(param)(param.to("meta"), requires_grad=param.requires_grad)

    # torch's registration hook, removed when this one model is built (no patch of nn.Module)
    # (torch types the hook as returning None; its docs and code take a returned parameter)
    handle = register_module_parameter_registration_hook(on_meta)  # type: ignore[arg-type]
    try:
        with _LargeAllocationsOnMeta():
            yield
    finally:
        handle.remove()


# Writes of values only (shape, dtype and strides kept): on a meta tensor they store nothing,
# and a modeling file's weight init runs one on every parameter -- through torch's Python
# reference kernels on meta, more than half the time it takes to build a model there.
# transformers swaps its own guarded copies of torch.nn.init's functions in while it inits.
_INIT_WRITES = frozenset(name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_"))
_INIT_MODULES = frozenset({"torch.nn.init", "transformers.initialization"})
_TENSOR_WRITES = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_})


def _meta_value_write(func: Any, args: Any, kwargs: Any) -> torch.Tensor | None:
    """The meta tensor ``func`` would write values into, if it is such a write."""
    if func not in _TENSOR_WRITES and not (
        getattr(func, "__module__", None) in _INIT_MODULES and getattr(func, "__name__", None) in _INIT_WRITES
    ):
        return None
    target = args[0] if args else (kwargs or {}).get("tensor")
    return target if isinstance(target, torch.Tensor) and target.is_meta else None


class _LargeAllocationsOnMeta(TorchFunctionMode):
    """Tensors of 2**28 elements (1 GiB in fp32) or more made without a device go to meta, and
    value writes into meta tensors (the weight init) are skipped.

    A parameter is allocated (``torch.empty``) before it is registered: one DeepSeek-V3 experts
    weight is 28 GiB, more than this machine has. Buffers computed in ``__init__`` (rotary
    frequencies, scales) are orders of magnitude smaller and stay real, as
    ``parameters_on_meta`` needs.
    """

    _FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn})
    _LARGE = 1 << 28

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (target := _meta_value_write(func, args, kwargs)) is not None:
            return target  # what the write returns: its tensor
        kwargs = dict(kwargs or {})
        if func in self._FACTORIES and kwargs.get("device") is None:
            sizes = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if func is torch.full:
                sizes = args[0] if args else kwargs.get("size", ())
            shape = [s for s in sizes if isinstance(s, int)]
            if len(shape) == len(sizes) and math.prod(shape) >= self._LARGE:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


# The dtype a trained model's parameters (the optimizer's master weights) and its AdamW state
# are held in, whatever ``config.dtype`` says: every real checkpoint says bfloat16, and
# transformers builds in it when not told otherwise, so AdamW at an RL learning rate (1e-6 on
# weights of scale 0.02) would round most updates away. Compute in bf16 comes from FSDP2's
# ``MixedPrecisionPolicy(param_dtype=...)``, as in torchtitan and verl; an export writes the
# config's own dtype again.
MASTER_DTYPE = torch.float32


def build_model(
    config: PretrainedConfig, *, device: str | torch.device = "meta", dtype: torch.dtype | None = None
) -> nn.Module:
    """The causal-LM module of ``config``. With ``device="meta"`` parameters allocate
    nothing (buffers are real, see ``parameters_on_meta``). ``dtype`` (e.g. ``MASTER_DTYPE``)
    overrides ``config.dtype``; transformers then writes it into ``config``, so pass a copy."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype} if dtype else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if str(device) == "meta":
            with parameters_on_meta():
                return AutoModelForCausalLM.from_config(config, **kwargs)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, **kwargs)


def build_meta_model(model: str | Path | Any) -> nn.Module:
    """A meta-device model from anything ``load_config`` takes, or a module as it is. A config
    transformers accepts but cannot build a model from (fields that contradict each other) is
    a ``model-config`` error naming what broke, never a traceback."""
    if isinstance(model, nn.Module):
        return model
    config = load_config(model)
    try:
        return build_model(config)
    except Exception as exc:  # whatever a modeling file's __init__ raises on a config it cannot take
        # a config read from a folder knows its path (transformers records it)
        where = str(model) if isinstance(model, (str, Path)) else getattr(config, "_name_or_path", "") or "<config>"
        raise _config_error(
            where,
            f"transformers cannot build {architecture_of(config)} from this config: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
            "compare the config's fields with one saved by the pinned transformers release",
        ) from None


def decoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList] | None:
    """(parent, attribute, list) of the model's decoder layers: its longest ``ModuleList``."""
    lists = [(m, n, c) for m in model.modules() for n, c in m.named_children() if isinstance(c, nn.ModuleList)]
    return max(lists, key=lambda found: len(found[2]), default=None)


def decoder_layers_glob(model: nn.Module) -> str | None:
    """The glob of every decoder layer (``model.layers.*``): what "full" checkpointing names."""
    found = decoder_layers(model)
    if found is None:
        return None
    return f"{next(n for n, m in model.named_modules() if m is found[2])}.*"
