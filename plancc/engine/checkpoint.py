"""Checkpoints with torch.distributed.checkpoint (DCP): saved atomically, never destroyed by a
later save, resumable at another (dp, cp, tp) layout, and read without executing anything
from the folder.

Layout of a checkpoint directory::

    DIR/step-000005/      DCP shards + .metadata, plus plancc.json (what was saved, how)
    DIR/latest            the name of the newest complete step directory
    DIR/.lock             held by the run that saves into DIR (a second one is refused)

``--save-every N`` writes a step every N steps; ``--keep K`` then removes all but the newest K
(``prune``), never the one ``latest`` names.

A step is written into ``DIR/.partial-step-000005-<token>`` and moved into place only after
every rank has finished writing and plancc.json is on disk. Re-saving a step that exists
moves the old one aside (``.replaced-...``) before the new one is moved in, and deletes it
only after ``latest`` names the new one; ``latest`` is replaced through a fresh temporary file
(never a name an attacker could plant a link at). Whatever point a crash hits, the newest
complete step is still found: ``find`` falls back to scanning complete steps when ``latest``
names nothing usable.

Reading (``checkpoint_reader``): DCP's ``.metadata`` is a pickle and its non-tensor items are
``torch.load``ed with ``weights_only=False``; a checkpoint shared between people must not run
code on resume, so plancc reads the metadata with an unpickler that admits DCP's own metadata
classes only, loads non-tensor items with ``weights_only=True``, and refuses shard paths outside
the folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import faults
from ..runtime.rank_agreement import agreed, on_rank0
from .checkpoint_error import CheckpointError
from .checkpoint_error import is_int as _is_int
from .checkpoint_error import refusal as _error

# DCP (and DTensor under it, ~1.5 s of imports) is imported where a step is saved or loaded,
# not here: the launcher checks --save/--resume folders with this module before any worker
# starts, and a run that neither saves nor resumes never needs it.

META = "plancc.json"
LATEST = "latest"
# checkpoints written before the optimizer state went by parameter name number its groups
_NUMBERED_GROUPS = re.compile(r"^optim\.param_groups\.\d+\.")
LOCK = ".lock"
_STEP_NAME = re.compile(r"^step-\d{6,}$")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    step: int
    architecture: str
    model_signature: str  # shapes of every parameter: refuses a checkpoint of another model
    plan: str
    dp: int
    cp: int
    tp: int
    ep: int = 1  # expert parallelism (absent before plancc 0.3)
    pp: int = 1  # pipeline stages (absent before pipeline parallelism)
    dp_replicate: int = 1  # HSDP's replicas among the dp ranks (absent before HSDP)
    # name -> global shape of every parameter, to say which one differs (absent in plancc 0.1)
    parameters: dict[str, list[int]] = field(default_factory=dict)
    # the LR schedule's counters (plancc.Policy with an lr_scheduler; absent before plancc 0.4)
    schedule: dict[str, Any] = field(default_factory=dict)
    # the run's settings that fix its learning rate (``plancc apply``'s total steps, warmup,
    # horizon, lr), so a resume with other ones says so; absent before plancc 0.5 and for a
    # caller's own loop unless it passes ``Policy.save(run=...)``
    run: dict[str, Any] = field(default_factory=dict)
    # LoRA: only the trained tensors (the adapters) and their optimizer state are in the
    # checkpoint; the frozen base is the run's --model, loaded by the resuming run as it was
    # here (``base`` names where it came from)
    adapters_only: bool = False
    base: str = ""


def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Names and global shapes of the parameters (layout independent: DTensors report their
    global shape, and a meta-device model gives the same as a parallelized one)."""
    return {name: list(p.shape) for name, p in model.named_parameters()}


def model_signature(model: torch.nn.Module) -> str:
    """Names and global shapes of the parameters, as one short hash."""
    return _signature(parameter_shapes(model))


def _signature(shapes: dict[str, list[int]]) -> str:
    parts = [f"{name}:{tuple(shape)}" for name, shape in shapes.items()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


# --------------------------------------------------------------------------- the folder lock
class FolderLock:
    """An exclusive lock on a checkpoint folder, held by one process for a whole run.

    ``flock`` is released by the kernel when the holder dies, so a crashed run never leaves
    the folder locked; a second run saving into the same folder is refused with the first
    one's pid instead of interleaving its steps with the first one's.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK
        _refuse_odd_lock(path)
        try:  # O_NOFOLLOW: a link planted at the lock's name is never written through
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            raise _error(path, f"cannot open the folder's lock file: {exc.strerror or exc}", _LOCK_FIX) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise _error(
                self.root,
                f"another run ({holder}) is saving checkpoints into this folder",
                "wait for it to finish, or pass another --save folder",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


_LOCK_FIX = "remove it (plancc makes a plain file there), or pass another --save folder"


def _refuse_odd_lock(path: Path) -> None:
    """A ``.lock`` that is a folder, a symbolic link or a pipe: named, never opened or written through."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a plain file"
        raise _error(path, f"the checkpoint folder's lock file {LOCK} is {what}", _LOCK_FIX)


def check_save_folder(root: str | Path) -> None:
    """Before a run starts: the folder can be created and written, and no other run holds it."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise _error(path, "--save names an existing file, not a folder", "pass a folder (it is created if missing)")
    probe = path if path.exists() else next((p for p in path.parents if p.exists()), Path("/"))
    if not os.access(probe, os.W_OK | os.X_OK) or os.path.realpath(path).startswith(("/proc", "/sys", "/dev")):
        raise _error(path, f"cannot write checkpoints here ({probe} is not writable)", "pass a writable folder")
    _refuse_odd_lock(path / LOCK)
    if (path / LOCK).is_file():  # a run may hold it; without a lock file none does, and none is made
        FolderLock(path).acquire().release()


# --------------------------------------------------------------------------- saving
def _write_file_atomically(path: Path, text: str) -> None:
    """Write through a fresh temporary file in the same folder, then rename over ``path``:
    readers see the old or the new content, and a link planted at a predictable temporary
    name is never followed (mkstemp creates its file exclusively)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the pointer from other users of a shared folder
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        faults.inject("latest" if path.name == LATEST else "meta", rank=0)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _publish(root: Path, partial: Path, final: Path, token: str) -> Path | None:
    """Move a finished step into place; returns the old copy of the same step, moved aside."""
    aside = None
    if final.exists():
        aside = root / f".replaced-{final.name}-{token}"
        os.rename(final, aside)
        faults.inject("publish", rank=0)  # a crash here: the old copy is found by find()'s scan
    os.rename(partial, final)
    return aside


def _remove_leftovers(root: Path, keep: Path | None) -> None:
    """Unfinished steps and moved-aside copies of crashed runs: once a newer step is
    published (and this run holds the folder's lock) nothing can still be writing them."""
    for entry in root.iterdir():
        if (
            entry.is_dir()
            and not entry.is_symlink()
            and entry != keep
            and entry.name.startswith((".partial-step-", ".replaced-step-", ".removing-step-"))
        ):
            shutil.rmtree(entry, ignore_errors=True)


def _shared_token() -> str:
    token = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(token, src=0)
    return str(token[0])


def save(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    info: CheckpointInfo,
    files: Mapping[str, str] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the finished step directory. Weights that are
    not finite are refused (a ``PlanError`` on every rank): no checkpoint ever holds them.
    ``files``: text files of the caller's (a run file) written into the step, published with it.
    ``info.adapters_only``: the frozen parameters are left out (LoRA's base)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ..runtime.hf_weights import refuse_non_finite_weights  # lazy: the launcher's checks run without DTensor

    refuse_non_finite_weights(model, what=f"saving step {info.step}")
    root = Path(root)
    final = _step_dir(root, info.step)
    partial = root / f".partial-{final.name}-{_shared_token()}"
    intact = "free disk space or pass another --save folder; the previous checkpoint is intact"

    def make_folders() -> None:
        root.mkdir(parents=True, exist_ok=True)
        partial.mkdir()

    # rank 0's file work ends in an agreement, not a barrier: its failure is every rank's at once
    on_rank0(make_folders, fail=lambda why: _error(final, f"saving step {info.step} failed: {why}", intact))
    # the optimizer's state and groups keyed by parameter name: a pipeline rank's groups hold
    # other parameters than another's, and groups numbered 0.. on every rank would collide
    options = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=info.adapters_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise _error(final, f"saving step {info.step} failed: {_first_line(exc)}", intact) from None

    # every rank's shards are written (DCP agreed on its own failures); what follows on any rank
    # before publishing is agreed too, where a barrier would leave the others waiting
    def refused(why: str) -> CheckpointError:
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        return _error(final, f"saving step {info.step} failed: {why}", intact)

    agreed(lambda: faults.inject("save", rank=dist.get_rank()), fail=refused)

    def publish() -> None:
        try:
            for name, text in (files or {}).items():
                _write_file_atomically(partial / Path(name).name, text)
            _write_file_atomically(partial / META, json.dumps(asdict(info), indent=2))
            aside = _publish(root, partial, final, partial.name.rsplit("-", 1)[1])
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # never published: this save's own folder
            raise
        _write_file_atomically(root / LATEST, final.name + "\n")
        _remove_leftovers(root, keep=aside)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    on_rank0(publish, fail=lambda why: _error(final, f"publishing step {info.step} failed: {why}", intact))
    return final


def prune(root: str | Path, *, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete steps (``--keep``); returns what went.
    Rank 0, while holding the folder's lock, after a newer step is published. The step
    ``latest`` names is never removed; each old step is renamed out of the step namespace
    first (one atomic rename), so a crash mid-removal leaves no half step that ``find``
    could take for a checkpoint."""
    root = Path(root)
    steps = [p for p in _candidates(root) if _STEP_NAME.match(p.name)]  # newest first
    latest = _latest_target(root)
    removed = []
    for old in steps[keep:]:
        if latest is not None and old == latest:
            continue
        doomed = root / f".removing-{old.name}-{uuid.uuid4().hex[:8]}"
        faults.inject("prune", rank=0)
        os.rename(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(old)
    return removed


def _wrapped(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's CheckpointException ((exception, traceback) pairs)."""
    from torch.distributed.checkpoint.api import CheckpointException

    failures = exc.failures if isinstance(exc, CheckpointException) else {}
    return [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def _first_line(exc: BaseException) -> str:
    """The first line of the root cause of a (DCP-wrapped) failure."""
    inner = _wrapped(exc)
    if inner:
        exc = inner[0]
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


# --------------------------------------------------------------------------- finding
def _is_complete(step_dir: Path) -> bool:
    return (step_dir / META).is_file() and (step_dir / ".metadata").is_file()


def _candidates(root: Path) -> list[Path]:
    """Complete step folders, newest step first (a step moved aside counts, after its twin)."""
    found = []
    for entry in root.iterdir() if root.is_dir() else ():
        name = entry.name
        replaced = name.startswith(".replaced-step-")
        if entry.is_dir() and not entry.is_symlink() and (_STEP_NAME.match(name) or replaced) and _is_complete(entry):
            step = int(re.findall(r"step-(\d+)", name)[0])
            found.append((step, not replaced, entry))
    return [entry for _, _, entry in sorted(found, key=lambda t: (t[0], t[1]), reverse=True)]


def _latest_target(root: Path) -> Path | None:
    """The step ``latest`` names, if it is a plain step name of this folder."""
    pointer = root / LATEST
    if not pointer.is_file() or pointer.is_symlink():
        return None
    name = pointer.read_text(errors="replace").strip()
    if not _STEP_NAME.match(name):  # '../..', absolute paths and anything else: not followed
        return None
    return root / name


def newest(root: str | Path | None) -> Path | None:
    """``find(root)``, or None where there is no folder or no complete step in it."""
    if not root:
        return None
    try:
        return find(root)
    except CheckpointError:
        return None


def find(root: str | Path) -> Path:
    """The newest complete step directory under ``root`` (or ``root`` itself if it is one)."""
    root = Path(root)
    if not root.exists():
        raise _error(root, "no such checkpoint folder", "pass the --save folder of an earlier run")
    if _is_complete(root):
        return root
    target = _latest_target(root)
    if target is not None and _is_complete(target):
        return target
    candidates = _candidates(root)
    if candidates:  # 'latest' is missing, hostile or names an unfinished step: the newest complete one
        return candidates[0]
    raise _error(
        root,
        "no complete checkpoint here (no step folder with .metadata and plancc.json)",
        "pass the --save folder of an earlier run",
    )


def agreed_find(root: str | Path) -> Path:
    """Collective: ``find(root)`` as rank 0 sees it, on every rank (or rank 0's refusal, raised on
    every rank): on a shared file system each rank's own look may see another newest step while
    a run still writes, and ranks that load different steps train different models."""
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            answer = [str(find(root))]
        except CheckpointError as exc:
            answer = [exc.diagnostics]
    dist.broadcast_object_list(answer, src=0)
    if not isinstance(answer[0], str):
        raise CheckpointError(answer[0])
    return Path(answer[0])


def read_info(step_dir: Path) -> CheckpointInfo:
    try:
        data = json.loads((step_dir / META).read_text())
        if not isinstance(data, dict):
            raise TypeError(f"it holds {type(data).__name__}, not a mapping")
        info = CheckpointInfo(**data)
    except (OSError, ValueError, TypeError, RecursionError) as exc:
        raise _error(
            step_dir / META, f"unreadable checkpoint metadata: {str(exc)[:200]}", "resume from another step"
        ) from None
    wrong = _info_problem(info)
    if wrong:  # a step of "2", 2.5 or -2 would train "step -2/-2" with a negative learning rate
        raise _error(step_dir / META, f"checkpoint metadata {wrong}", "resume from another step, one plancc saved")
    return info


def _info_problem(info: CheckpointInfo) -> str | None:
    """What in a read ``plancc.json`` is not what plancc writes, or None."""
    if not _is_int(info.step, 0):
        return f"says step {info.step!r}: a step is a whole number >= 0"
    for name in ("dp", "cp", "tp", "ep", "pp"):
        if not _is_int(getattr(info, name), 1):
            return f"says {name} {getattr(info, name)!r}: a parallel degree is a whole number >= 1"
    for name in ("architecture", "model_signature", "plan"):
        if not isinstance(getattr(info, name), str):
            return f"says {name} {getattr(info, name)!r}: expected a string"
    shapes = info.parameters
    if not isinstance(shapes, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(_is_int(d, 0) for d in v) for k, v in shapes.items()
    ):
        return "has 'parameters' that are not a mapping of names to shapes"
    for name in ("schedule", "run"):
        if not isinstance(getattr(info, name), dict):
            return f"has a {name!r} of {type(getattr(info, name)).__name__}, not a mapping"
    return None


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def same_base(saved: str, built: str) -> bool:
    """Whether two ``weight_source`` phrases name one base: the same seed, or the same folder
    however its path is spelled."""
    prefix = "safetensors from "
    if saved.startswith(prefix) and built.startswith(prefix):
        return Path(saved.removeprefix(prefix)).resolve() == Path(built.removeprefix(prefix)).resolve()
    return saved == built


def compatible(info: CheckpointInfo, step_dir: Path, *, architecture: str, shapes: dict[str, list[int]]) -> None:
    """Refuse a checkpoint of another model, naming the first parameter that differs."""
    if info.architecture != architecture:
        raise _error(
            step_dir,
            f"checkpoint is of {info.architecture}, this run builds {architecture}",
            "resume with the --model the checkpoint was saved with",
        )
    signature = _signature(shapes)
    if info.model_signature == signature:
        return
    saved_adapters = [n for n in info.parameters if _is_adapter(n)]
    built_adapters = [n for n in shapes if _is_adapter(n)]
    if info.parameters and bool(saved_adapters) != bool(built_adapters):
        raise _error(
            step_dir,
            f"checkpoint holds LoRA adapters ({saved_adapters[0]}), this policy has none"
            if saved_adapters
            else f"checkpoint holds no LoRA adapters, this policy has them ({built_adapters[0]})",
            "construct the policy with the lora= the checkpoint was saved with"
            if saved_adapters
            else "construct the policy without lora= to resume a full fine-tuning checkpoint",
        )
    for name in sorted(set(info.parameters) | set(shapes)):
        saved, built = info.parameters.get(name), shapes.get(name)
        if saved != built and info.parameters:
            raise _error(
                step_dir,
                f"checkpoint is of {info.architecture} with parameter {name} of shape "
                f"{saved or 'absent'}, this run builds it {built or 'absent'}",
                "resume with the lora r and targets the checkpoint was saved with"
                if _is_adapter(name)
                else "resume with the --model the checkpoint was saved with",
            )
    raise _error(
        step_dir,
        f"checkpoint is of {info.architecture} (signature {info.model_signature}), this run "
        f"builds {architecture} (signature {signature})",
        "resume with the --model the checkpoint was saved with",
    )


def load(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    architecture: str,
    plan: str,
    shapes: dict[str, list[int]] | None = None,
    base: str | None = None,
    aliases: Mapping[str, str] | None = None,
) -> CheckpointInfo:
    """Collective: load model and optimizer state saved at any layout into this one. ``aliases``:
    a tied weight's copy -> the weight (``engine.pipeline.pipeline_ties``), whose optimizer state a
    checkpoint saved without pipeline stages holds once, under the weight's name. ``shapes``:
    the whole model's parameter shapes, where ``model`` holds only some of them (a pipeline
    rank's stages); default ``model``'s own. ``base``: where this model's frozen base came from
    (LoRA), which must be the base a checkpoint of adapters alone was trained on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from .checkpoint_reader import SafeFileSystemReader, SafeLoadPlanner  # lazy: DCP only when loading

    step_dir = agreed_find(root)
    info = read_info(step_dir)
    compatible(info, step_dir, architecture=architecture, shapes=shapes or parameter_shapes(model))
    if info.adapters_only and base is not None and info.base and not same_base(info.base, base):
        raise _error(
            step_dir,
            f"the checkpoint holds LoRA adapters trained on the base '{info.base}', which it does not hold; "
            f"this policy's base is '{base}'",
            "resume with the --model (and, for a random init, the --seed) the checkpoint's run used",
        )
    reader = SafeFileSystemReader(str(step_dir))
    # checkpoints before the optimizer state went by name number its groups (optim.param_groups.0...)
    saved = set(reader.read_metadata().state_dict_metadata)
    numbered = any(_NUMBERED_GROUPS.match(key) for key in saved)
    # a LoRA checkpoint holds the adapters alone: the frozen base stays as this run loaded it
    options = StateDictOptions(
        flatten_optimizer_state_dict=not numbered,
        ignore_frozen_params=info.adapters_only,
        strict=not info.adapters_only,  # (the frozen keys are absent by design; every adapter is loaded)
    )
    model_sd, optim_state = get_state_dict(model, optimizer, options=options)
    optim_sd: dict[str, Any] = dict(optim_state)  # flattened: one value a key
    reading, copied = _tied_reads(optim_sd, {} if numbered else dict(aliases or {}), saved)
    try:  # DCP loads in place, into the tensors of these two state dicts
        dcp.load({"model": model_sd, "optim": reading}, storage_reader=reader, planner=SafeLoadPlanner())
        for key, other in copied.items():  # the copies' state: their weight's, read once
            value = reading[other]
            optim_sd[key] = value.clone() if isinstance(value, torch.Tensor) and other in optim_sd else value
        optim_sd.update({key: value for key, value in reading.items() if key in optim_sd})
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP reports mismatches deep inside; say what it means
        refused = _refusal(exc)
        if refused is not None:
            raise refused from None
        raise _error(
            step_dir,
            f"checkpoint does not fit this model/plan or is damaged: {_first_line(exc)}",
            f"resume with the plan the checkpoint was saved with ({info.plan}), or from another step",
        ) from None
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    return info


def _tied_reads(
    optim_sd: dict[str, Any], aliases: dict[str, str], saved: set[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The optimizer state to read, and {a tied copy's key: the weight's key it is read from} for
    the copies the checkpoint holds no state of (saved without pipeline stages, where the tie is
    one tensor with one state). A copy whose weight this rank holds too (a V schedule) is read
    once, into the weight's entry, and cloned after."""
    copied: dict[str, str] = {}
    for key in optim_sd:
        for copy, weight in aliases.items():
            other = key.replace(copy, weight)
            if copy in key and f"optim.{key}" not in saved and f"optim.{other}" in saved:
                copied[key] = other
    reading = {key: value for key, value in optim_sd.items() if key not in copied}
    for key, other in copied.items():
        reading.setdefault(other, optim_sd[key])
    return reading, copied


def _refusal(exc: BaseException) -> CheckpointError | None:
    """A plancc refusal raised inside DCP (it wraps exceptions of every rank)."""
    if isinstance(exc, CheckpointError):
        return exc
    for inner in _wrapped(exc):
        if isinstance(inner, CheckpointError):
            return inner
    cause = exc.__cause__ or exc.__context__
    return _refusal(cause) if cause is not None and cause is not exc else None
