"""The layering rules that import-linter cannot express, read off the source.

import-linter (``.importlinter``, run by ``.ci/run``) enforces that layers import only
downward and that no layer has an import cycle. It sees ``torch`` only as one package, so the
rule that the front end never touches process-group code, and the rule against project
imports hidden inside functions, are checked here on the syntax tree.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

PACKAGE = ROOT / "plancc"
FRONT_END = [*sorted((PACKAGE / "compiler").glob("*.py")), *sorted((PACKAGE / "checks").glob("*.py")),
             PACKAGE / "skeleton.py", PACKAGE / "layout.py", PACKAGE / "models.py", PACKAGE / "errors.py",
             PACKAGE / "dataflow.py"]
# None: the front end ends at torch-free declarations and plain placements; styles and
# placements become torch objects only in the runtime (plancc.runtime.styles).
ALLOWED_DISTRIBUTED: set[str] = set()


def _imports(path: Path) -> list[tuple[str, int, ast.AST]]:
    """(module imported, relative level, node) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level, node))
    return found


@pytest.mark.parametrize("path", FRONT_END, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_front_end_never_imports_process_group_code(path):
    bad = [name for name, level, _ in _imports(path)
           if level == 0 and name.startswith(("torch.distributed", "torch._subclasses"))
           and name not in ALLOWED_DISTRIBUTED]
    assert not bad, f"{path.name} imports {bad}: the compiler and checks must run without a process group"


def _function_level_project_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("plancc")):
                found.append((node.lineno, "." * node.level + (node.module or "")))
            elif isinstance(node, ast.Import) and any(a.name.startswith("plancc") for a in node.names):
                found.append((node.lineno, node.names[0].name))
    return found


# Where a module-level import would cost every `plancc apply` launch seconds of CPU for what
# only some runs use: the launcher checks --save/--resume folders and LoRA flags with these
# modules before any worker starts, without DCP or DTensor (tests/test_startup.py).
LAZY_FOR_STARTUP = {
    "plancc/engine/checkpoint.py": {"..runtime.hf_weights", ".checkpoint_reader"},
    "plancc/job/preflight.py": {"..engine.checkpoint_reader"},
    "plancc/runtime/lora.py": {".styles.dtensor_placements"},
    "plancc/tools/suggest.py": {".measured_memory"},
}


def test_project_modules_are_imported_at_the_top_of_a_module_except_by_the_cli():
    """An import inside a function hides a dependency (and, before this rule, two import
    cycles). The CLI's commands alone import their modules lazily, so `plancc --help` does not
    pay for torch and transformers; and the few imports LAZY_FOR_STARTUP names, so that the
    launcher does not pay for DCP and DTensor, nor `plancc suggest` for FSDP's memory tracker.
    Each says why on its line (``# lazy: ...``), and they are counted: a new one is a choice
    this test makes visible."""
    offenders, reasons, count = {}, [], 0
    for p in sorted(PACKAGE.rglob("*.py")):
        name = str(p.relative_to(ROOT))
        source = p.read_text().splitlines()
        found = _function_level_project_imports(p)
        count += len(found)
        lines = [line for line, module in found if module not in LAZY_FOR_STARTUP.get(name, set())]
        if not name.startswith("plancc/cli/") and lines:
            offenders[name] = lines
        reasons += [f"{name}:{line}" for line, _ in found if "# lazy: " not in _statement(source, line)]
    assert offenders == {}
    assert reasons == []
    assert count == FUNCTION_LEVEL_IMPORTS, f"{count} function-level imports of plancc modules"


# the count the rule above pins (issue 61: 45 before the CLI became a package of commands, light
# modules imported at the top of the commands that use them; 39 with apply's --lora-* flags held to
# the compile check's answer, checks.compiled_blocks.with_lora; 41 with the launcher's memory
# estimate (cli.launching: job.memory) and suggest --write (cli.suggest_command: tools.suggest_run))
FUNCTION_LEVEL_IMPORTS = 41


def _statement(source: list[str], line: int) -> str:
    """The import statement starting at ``line`` (1-based), through its closing parenthesis."""
    text = source[line - 1]
    index = line
    while "(" in text and ")" not in text and index < len(source):
        text += source[index]
        index += 1
    return text


def test_the_folders_show_the_layers():
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert layers == {"compiler", "checks", "runtime", "engine", "job", "tools", "cli"}


def test_validating_a_plan_initializes_no_process_group():
    code = ("import torch.distributed as dist\n"
            "from plancc.checks.report import validate_plan\n"
            "report = validate_plan('plans/qwen3.yaml', model='tiny-qwen3', tp=2)\n"
            "assert not report.has_errors, report.diagnostics\n"
            "assert not dist.is_initialized()\n"
            "import sys; print(sorted(m for m in sys.modules if m.startswith('plancc.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert not [m for m in loaded if m.startswith(("plancc.runtime", "plancc.engine", "plancc.job", "plancc.tools"))]
