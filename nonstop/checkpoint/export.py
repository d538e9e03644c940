"""``nonstop export``: a durable checkpoint written in a format other tools load.

What is written (``what``):

* ``model`` (the default): the model's ``state_dict()`` -- gathered for a sharded job, once for a
  data-parallel one -- loadable straight into ``model.load_state_dict``;
* ``optimizer``: the optimizer's ``state_dict()`` (``{"state": {index: {...}}, "param_groups":
  [...]}``, DTensor state gathered);
* ``all``: ``{"step", "world_size", "model", "optimizer", "extras"}`` (extras: each rank's, a
  list by rank; NumPy arrays in them become tensors). Not for safetensors, which holds tensors only.

Formats (``fmt``):

* ``safetensors``: a file for ``safetensors.torch.load_file``. ``model``: the tensors by their
  state-dict names; ``optimizer``: tensor ``state.<index>.<name>`` for each state tensor, and in
  the file's metadata ``param_groups`` and ``state_values`` (the non-tensor state) as JSON.
  Metadata ``nonstop_step`` names the step. Needs the ``safetensors`` package (the ``export``
  extra): without it a one-line UsageError says so;
* ``dcp``: a ``torch.distributed.checkpoint`` directory, saved by one process (no process group):
  ``dcp.load(model.state_dict(), checkpoint_id=OUT)`` in a plain process fills a model;
* ``torch``: a ``torch.save`` file of plain state dicts, tensors and Python values only, which
  ``torch.load(OUT, weights_only=True)`` reads.

Contract: the output appears whole or not at all (written under a temporary name beside it, then
renamed; an existing file is replaced, an existing DCP directory too -- any other existing
directory is refused). Bad input raises UsageError with one line (unknown format or ``what``,
``all`` for safetensors, no optimizer state, an output that cannot be written); a checkpoint
that is missing or unusable raises :class:`~nonstop.errors.SnapshotError` (see
:func:`~nonstop.checkpoint.reader.load_checkpoint`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nonstop.checkpoint.reader import Checkpoint, load_checkpoint
from nonstop.errors import UsageError

__all__ = ["FORMATS", "WHATS", "ExportResult", "export_checkpoint"]

FORMATS = ("safetensors", "dcp", "torch")
WHATS = ("model", "optimizer", "all")


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    step: int
    world_size: int
    sharded: bool
    path: Path
    tensors: int
    bytes: int


def check_choice(fmt: str, what: str) -> None:
    """UsageError (one line) unless ``fmt`` and ``what`` are a combination that can be written."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    if what not in WHATS:
        raise UsageError(f"unknown --what {what!r}: use one of {', '.join(WHATS)}")
    if fmt == "safetensors" and what == "all":
        raise UsageError(
            "safetensors holds tensors only: export --what model or --what optimizer "
            "(or --what all as dcp or torch)"
        )
    if fmt == "safetensors":
        _safetensors()


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise UsageError(
            "the safetensors format needs the safetensors package: pip install 'nonstop[export]' "
            "(or pip install safetensors)"
        ) from None
    return safetensors.torch


def export_checkpoint(
    url: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fmt: str,
    what: str = "model",
    step: int | None = None,
) -> ExportResult:
    """Write checkpoint ``step`` (None: the newest good one) of durable location ``url`` to
    ``out`` as ``fmt`` (see the module docstring)."""
    check_choice(fmt, what)
    path = Path(out)
    _check_out(path, fmt)
    ckpt = load_checkpoint(url, step, ranks=what == "all")
    obj = _select(ckpt, what)
    writer: Callable[[Any, Path, Checkpoint, str], None] = {
        "safetensors": _write_safetensors,
        "dcp": _write_dcp,
        "torch": _write_torch,
    }[fmt]
    _atomic(path, lambda tmp: writer(obj, tmp, ckpt, what), directory=fmt == "dcp")
    tensors = _tensors(obj)
    return ExportResult(
        step=ckpt.step,
        world_size=ckpt.world_size,
        sharded=ckpt.sharded,
        path=path,
        tensors=len(tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors),
    )


def _select(ckpt: Checkpoint, what: str) -> Any:
    if what == "model":
        return ckpt.model
    if what == "optimizer":
        if ckpt.optimizer is None:
            raise UsageError(f"checkpoint step {ckpt.step} holds no optimizer state: export --what model")
        return ckpt.optimizer
    return ckpt.state_dict()


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# ---------------------------------------------------------------------------- the output
def _check_out(path: Path, fmt: str) -> None:
    if str(path) in ("", "."):
        raise UsageError("--out needs a file name (a directory for dcp)")
    if path.is_dir():
        if fmt != "dcp":
            raise UsageError(f"--out {path} is a directory: give the {fmt} file's name")
        if any(path.iterdir()) and not (path / ".metadata").exists():
            raise UsageError(
                f"--out {path} is a directory that is not a DCP checkpoint: give a new or empty directory"
            )
    elif path.exists() and fmt == "dcp":
        raise UsageError(f"--out {path} is a file: a dcp export is a directory")
    parent = path.absolute().parent
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"--out {path}: {parent} is not a directory")


def _atomic(path: Path, write: Callable[[Path], None], *, directory: bool) -> None:
    """``write`` the output under a temporary name beside ``path``, then rename it over ``path``."""
    try:
        path.absolute().parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {path}: cannot create its directory ({e.strerror or e})") from None
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    old = path.with_name(f".{path.name}.old-{secrets.token_hex(4)}")
    try:
        write(tmp)
        if directory and path.exists():
            os.replace(path, old)  # a directory cannot be renamed over a non-empty one
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"--out {path}: cannot write it ({e.strerror or e})") from None
    finally:
        for leftover in (tmp, old):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            elif leftover.exists():
                leftover.unlink()


def _write_torch(obj: Any, tmp: Path, ckpt: Checkpoint, what: str) -> None:
    del ckpt, what
    torch.save(obj, tmp)


def _write_dcp(obj: Any, tmp: Path, ckpt: Checkpoint, what: str) -> None:
    del ckpt, what
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        save(obj, checkpoint_id=str(tmp), no_dist=True)


def _write_safetensors(obj: Any, tmp: Path, ckpt: Checkpoint, what: str) -> None:
    st = _safetensors()
    meta = {"format": "pt", "nonstop_step": str(ckpt.step)}
    if what == "model":
        st.save_file({k: t.contiguous() for k, t in obj.items()}, str(tmp), metadata=meta)
        return
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    for index, entries in obj.get("state", {}).items():
        for name, v in entries.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{index}.{name}"] = v.contiguous()
            else:
                values.setdefault(str(index), {})[name] = v
    meta["param_groups"] = json.dumps(obj.get("param_groups", []))
    meta["state_values"] = json.dumps(values)
    st.save_file(tensors, str(tmp), metadata=meta)
