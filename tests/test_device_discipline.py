"""Device-clean by construction: every tensor the runtime and the engine make from nothing names
its device.

``torch.tensor(n)`` without ``device=`` is a CPU tensor; beside CUDA tensors it breaks
``torch.stack`` / ``torch.cat`` / a collective on NCCL -- only on a GPU, at tp or cp > 1, which
the CPU suite never runs (issue: the row fingerprint of ``Policy`` raised on every CUDA train
at tp > 1). A tensor factory called without ``device=`` is the whole class of that bug, and it
can be found by reading the code: this test reads it. A tensor that belongs on the host says so
(``device="cpu"``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "plancc"
# torch functions that make a tensor from nothing (the *_like ones take their input's device)
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "eye", "rand", "randn",
             "randint", "randperm"}


def factories_without_device(source: str, name: str) -> list[str]:
    """``name:line: ...`` for each torch tensor factory in ``source`` called without ``device=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append(f"{name}:{node.lineno}: torch.{node.func.attr}(...) without device=")
    return found


def test_every_tensor_the_runtime_and_engine_make_names_its_device():
    found = [line for layer in ("runtime", "engine") for path in sorted((ROOT / layer).rglob("*.py"))
             for line in factories_without_device(path.read_text(), str(path.relative_to(ROOT.parent)))]
    assert not found, "\n".join(found)


def test_the_reader_finds_the_bug_it_exists_for():
    fingerprint = ("import torch\n\ndef fingerprint(ids, device):\n"
                   "    return torch.stack([ids.sum(), torch.tensor(ids.shape[1])])\n")
    assert factories_without_device(fingerprint, "policy.py") == ["policy.py:4: torch.tensor(...) without device="]
    assert factories_without_device(fingerprint.replace("[1])", "[1], device=device)"), "policy.py") == []
