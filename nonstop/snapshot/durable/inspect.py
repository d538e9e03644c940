"""``nonstop inspect``: :func:`describe` gathers what a root holds into a JSON-able report,
:func:`format_inspect` renders it as the human-readable table.

Contract: nothing here writes; :func:`describe` reads every manifest (and, with
``verify=True``, every byte through the loader); :func:`format_inspect` is pure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nonstop.errors import SnapshotError
from nonstop.snapshot.durable.catalog import Catalog
from nonstop.snapshot.durable.format import FORMAT_VERSION, one_line

__all__ = ["describe", "format_inspect"]


def describe(catalog: Catalog, verify: Callable[[int], list[str]] | None) -> dict[str, Any]:
    """A report of every checkpoint in ``catalog`` (see :func:`format_inspect`); ``verify``
    gives a checkpoint's problems (None: do not verify the data, only the manifests)."""
    latest, latest_problem = catalog.read_latest()
    dirs = catalog.step_dirs()
    checkpoints: list[dict[str, Any]] = []
    uncommitted: list[str] = []
    for s in sorted(dirs):
        if not catalog.has_manifest(dirs[s]):
            uncommitted.append(dirs[s])
            continue
        entry: dict[str, Any] = {"step": s, "dir": dirs[s], "latest": s == latest}
        try:
            m = catalog.read_manifest(s)
        except SnapshotError as e:
            entry.update(ok=False, problems=[one_line(e)])
            checkpoints.append(entry)
            continue
        data = sum(r.data_len for r in m.ranks)
        stored = sum(r.file_len for r in m.ranks)
        bases = sorted({r.base_step for r in m.ranks if r.base_step is not None})
        problems = verify(s) if verify is not None else []
        entry.update(
            world_size=m.world_size,
            codec=m.codec,
            created_at=m.created_at,
            base_step=bases[-1] if bases else None,
            delta_ranks=sum(r.base_step is not None for r in m.ranks),
            data_bytes=data,
            stored_bytes=stored,
            ratio=(data / stored) if stored else None,
            ok=not problems if verify is not None else None,
            problems=problems,
        )
        checkpoints.append(entry)
    return {
        "url": catalog.url,
        "format_version": FORMAT_VERSION,
        "latest": latest,
        "latest_problem": latest_problem,
        "checkpoints": checkpoints,
        "uncommitted": uncommitted,
    }


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)  # unreachable


def format_inspect(report: dict[str, Any]) -> str:
    """Human-readable table of a :meth:`DurableStore.describe` report."""
    lines = [f"checkpoints in {report['url']} (format v{report.get('format_version', FORMAT_VERSION)})"]
    if report.get("latest_problem"):
        lines.append(f"  ! {report['latest_problem']}")
    rows = [("", "STEP", "RANKS", "DATA", "STORED", "RATIO", "BASE", "CREATED", "STATUS", "CODEC")]
    for c in report["checkpoints"]:
        created = c.get("created_at")
        ratio = c.get("ratio")
        ok = c.get("ok")
        rows.append(
            (
                "*" if c.get("latest") else "",
                str(c["step"]),
                str(c.get("world_size", "?")),
                _human(c.get("data_bytes")),
                _human(c.get("stored_bytes")),
                f"{ratio:.2f}x" if ratio is not None else "-",
                "-" if c.get("base_step") is None else str(c["base_step"]),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created is not None else "-",
                "unchecked" if ok is None and not c.get("problems") else ("ok" if ok else "CORRUPT"),
                str(c.get("codec", "-")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    if not report["checkpoints"]:
        lines.append("  (no committed checkpoints)")
    for c in report["checkpoints"]:
        for p in c.get("problems") or ():
            lines.append(f"  step {c['step']}: {p}")
    if report.get("uncommitted"):
        lines.append(f"  uncommitted (abandoned) directories: {', '.join(report['uncommitted'])}")
    latest = report.get("latest")
    lines.append(f"  latest: {'step ' + str(latest) if latest is not None else 'none'}  (* marks it)")
    return "\n".join(lines)
