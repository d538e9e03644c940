"""Background encoding of a trained state's snapshot bytes: compression ratio and speed per codec.

What is measured
----------------
The demo's decoder-only transformer (``nonstop.demo.model``, preset ``--preset``, ``medium`` =
26M parameters by default) is trained with AdamW (``--lr``, the demo's 3e-3) on the demo's
Markov corpus for ``--steps`` steps (batch ``--batch``); the state after steps ``k = steps - 1``
and ``k + 1 = steps`` is ``flatten_state({"model": model.state_dict(), "optimizer":
opt.state_dict()})`` (params, ``exp_avg``, ``exp_avg_sq``, ``step``), laid out in one buffer like
``RankSnapshotStore`` (tensors at 64-byte aligned offsets). The trained pair is cached
(``--cache-dir``) so a second run skips training.

Variants (``--variants``):

* ``fp32``: the state as trained;
* ``bf16``: a bf16 copy: params and both Adam moments of steps k and k+1 cast to bfloat16
  (round to nearest even), step counters kept float32. A cast of the fp32 run, not a native
  bf16 training run (which would change fewer low bits per step).

Modes: ``full`` encodes step k+1 alone; ``delta`` encodes it against step k (the base).
Methods (``nonstop.snapshot.codec`` unless "plain"):

* ``zstd1+shuffle``, ``lz4+shuffle``, ``zstd1+bitshuffle``, ``lz4+bitshuffle``: C-Blosc2 codec and
  shuffle by element size, XOR delta;
* ``zstd1+shuffle+sub`` (delta only): the same with the ``sub`` delta (zig-zag integer difference);
* ``plain-zstd1``, ``plain-lz4``: ``zstandard`` level 1 / ``lz4.block`` on the raw (or XOR'd)
  bytes, no shuffle; same chunking, numpy XOR and crc32 checksums as the codec, so only the
  compressor differs;
* ``lossy-q8``, ``lossy-q4``: lossy mode (params and ``exp_avg`` "linear", ``exp_avg_sq``
  "sqrt", step counters exact). In ``delta`` mode the base is the exact step k (a full base
  kept lossless, as a reader holds it when full bases are encoded losslessly);
* ``lossy-q8-chain``, ``lossy-q4-chain`` (delta only): the base is step k encoded ``full`` with
  the same lossy setting and decoded (what a reader holds when full bases are lossy too).

Lossy errors are always against the exact step k+1 state.

Figures: ``ratio`` = raw bytes / payload bytes (manifests excluded); ``encode_mbps_per_core`` =
raw bytes / CPU seconds of the process while encoding with 1 thread (robust to other load on a
shared machine); ``encode_mbps_1t`` / ``encode_mbps_2t`` = raw bytes / wall seconds with 1 / 2
threads; ``decode_mbps`` = wall, 1 thread, checksums verified. Median of ``--reps`` repetitions
(one untimed warm-up encode first). Every lossless decode is compared with the input
(``roundtrip_ok``). Lossy errors per tensor kind: ``max_rel`` = max|y-x| / max|x|,
``mean_rel`` = mean|y-x| / mean|x|; for ``exp_avg_sq`` also in sqrt space; in delta mode
``mean_err_over_update`` = mean|y-x| / mean|x - x_k|.

How to run
----------
::

    .venv/bin/python benchmarks/bench_encode.py             # medium preset, ~3 min (incl. training)
    .venv/bin/python benchmarks/bench_encode.py --quick     # tiny preset, 1 rep, < 20 s

Results go to ``benchmarks/results/encode.json`` (``encode-quick.json`` with ``--quick``;
``--out`` overrides); a table is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.encodestate import layout, trained_pair, variant_tensors  # noqa: E402
from nonstop.demo.model import PRESETS  # noqa: E402
from nonstop.snapshot.api import TensorEntry  # noqa: E402
from nonstop.snapshot.codec import (  # noqa: E402
    CodecConfig,
    Encoder,
    Segment,
    decode,
    segments_for,
)

RESULTS = REPO_ROOT / "benchmarks" / "results"
DEFAULT_CACHE = REPO_ROOT / ".nonstop" / "bench-cache"
LOSSLESS = ("zstd1+shuffle", "lz4+shuffle", "zstd1+bitshuffle", "lz4+bitshuffle", "plain-zstd1", "plain-lz4")
LOSSY = ("lossy-q8", "lossy-q4")
DELTA_ONLY = ("zstd1+shuffle+sub", "lossy-q8-chain", "lossy-q4-chain")
GOALS = {"fp32_delta_ratio": 1.4, "bf16_delta_ratio": 2.5, "mbps_per_core": 700.0, "lossy_delta_ratio": 10.0}


# --------------------------------------------------------------------------- engines


class CodecEngine:
    """nonstop.snapshot.codec with one config."""

    def __init__(self, cfg: CodecConfig) -> None:
        self.cfg = cfg

    def encode(self, raw: np.ndarray[Any, Any], segs: list[Segment], base: Any, threads: int) -> Any:
        with Encoder(dataclasses.replace(self.cfg, threads=threads)) as enc:
            return enc.encode(raw, segs, base)

    def decode(self, chunks: Any, out: np.ndarray[Any, Any], base: Any) -> None:
        decode(chunks, out, base)

    def enc_bytes(self, chunks: Any) -> int:
        return sum(info.enc_len for info, _ in chunks)


class PlainEngine:
    """zstandard level 1 or lz4.block on unshuffled bytes, chunked, XOR delta, crc32 like the codec."""

    def __init__(self, codec: str, chunk_bytes: int) -> None:
        self.codec, self.chunk_bytes = codec, chunk_bytes
        self.local = threading.local()

    def _compress(self, data: np.ndarray[Any, Any]) -> bytes:
        if self.codec == "zstd":
            import zstandard

            if not hasattr(self.local, "c"):
                self.local.c = zstandard.ZstdCompressor(level=1)
            return bytes(self.local.c.compress(data))
        import lz4.block

        return bytes(lz4.block.compress(data, store_size=False))

    def _decompress(self, payload: bytes, n: int) -> bytes:
        if self.codec == "zstd":
            import zstandard

            if not hasattr(self.local, "d"):
                self.local.d = zstandard.ZstdDecompressor()
            return bytes(self.local.d.decompress(payload, max_output_size=n))
        import lz4.block

        return bytes(lz4.block.decompress(payload, uncompressed_size=n))

    def encode(self, raw: np.ndarray[Any, Any], segs: list[Segment], base: Any, threads: int) -> Any:
        b = None if base is None else np.frombuffer(base, np.uint8)

        def one(off: int) -> tuple[int, int, bytes, int, int]:
            x = raw[off : off + self.chunk_bytes]
            data = x
            if b is not None:
                if not hasattr(self.local, "s") or len(self.local.s) < len(x):
                    self.local.s = np.empty(self.chunk_bytes, np.uint8)
                data = self.local.s[: len(x)]
                np.bitwise_xor(x, b[off : off + len(x)], out=data)
            p = self._compress(data)
            return off, len(x), p, zlib.crc32(x.data), zlib.crc32(p)

        offs = range(0, len(raw), self.chunk_bytes)
        if threads == 1:
            return [one(o) for o in offs]
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, offs))

    def decode(self, chunks: Any, out: np.ndarray[Any, Any], base: Any) -> None:
        b = None if base is None else np.frombuffer(base, np.uint8)
        for off, n, p, crc_raw, crc_enc in chunks:
            assert zlib.crc32(p) == crc_enc
            o = out[off : off + n]
            o[:] = np.frombuffer(self._decompress(p, n), np.uint8)
            if b is not None:
                np.bitwise_xor(o, b[off : off + n], out=o)
            assert zlib.crc32(o.data) == crc_raw

    def enc_bytes(self, chunks: Any) -> int:
        return sum(len(c[2]) for c in chunks)


def make_engine(method: str, chunk_bytes: int) -> CodecEngine | PlainEngine:
    if method.startswith("plain-"):
        return PlainEngine("zstd" if "zstd" in method else "lz4", chunk_bytes)
    if method.startswith("lossy-"):
        bits = int(method.removeprefix("lossy-q").removesuffix("-chain"))
        return CodecEngine(CodecConfig(chunk_bytes=chunk_bytes, lossy=True, lossy_bits=bits))
    codec = "zstd" if method.startswith("zstd") else "lz4"
    shuffle = "bit" if "bitshuffle" in method else "byte"
    delta = "sub" if method.endswith("+sub") else "xor"
    return CodecEngine(CodecConfig(codec=codec, shuffle=shuffle, chunk_bytes=chunk_bytes, delta=delta))


# --------------------------------------------------------------------------- measuring


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """Result, wall seconds and process CPU seconds of ``fn()``, with the cyclic GC paused
    (a collection of torch's heap takes ~0.1 s and would land in random runs)."""
    gc.disable()
    try:
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - w0, time.process_time() - c0
    finally:
        gc.enable()


def _as_f32(buf: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    if dtype == "float32":
        return buf.view(np.float32)
    return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def lossy_errors(
    entries: list[TensorEntry],
    kinds: list[str],
    raw: np.ndarray[Any, Any],
    out: np.ndarray[Any, Any],
    prev: np.ndarray[Any, Any] | None,
) -> dict[str, dict[str, float]]:
    acc: dict[str, dict[str, float]] = {}
    for e, k in zip(entries, kinds, strict=True):
        if k not in ("param", "exp_avg", "exp_avg_sq") or e.dtype not in ("float32", "bfloat16"):
            continue
        sl = slice(e.offset, e.offset + e.nbytes)
        x = _as_f32(raw[sl], e.dtype).astype(np.float64)
        y = _as_f32(out[sl], e.dtype).astype(np.float64)
        a = acc.setdefault(k, {"n": 0, "sum_err": 0, "sum_x": 0, "max_err": 0, "max_x": 0, "sum_upd": 0})
        err = np.abs(y - x)
        a["n"] += x.size
        a["sum_err"] += float(err.sum())
        a["sum_x"] += float(np.abs(x).sum())
        a["max_err"] = max(a["max_err"], float(err.max(initial=0)))
        a["max_x"] = max(a["max_x"], float(np.abs(x).max(initial=0)))
        if prev is not None:
            a["sum_upd"] += float(np.abs(x - _as_f32(prev[sl], e.dtype)).sum())
        if k == "exp_avg_sq":
            se = np.abs(np.sqrt(np.maximum(y, 0)) - np.sqrt(np.maximum(x, 0)))
            a["sqrt_sum_err"] = a.get("sqrt_sum_err", 0) + float(se.sum())
            a["sqrt_sum_x"] = a.get("sqrt_sum_x", 0) + float(np.sqrt(np.maximum(x, 0)).sum())
            a["sqrt_max_err"] = max(a.get("sqrt_max_err", 0), float(se.max(initial=0)))
            a["sqrt_max_x"] = max(a.get("sqrt_max_x", 0), float(np.sqrt(np.maximum(x, 0)).max(initial=0)))
    res: dict[str, dict[str, float]] = {}
    for k, a in acc.items():
        r = {
            "max_rel": a["max_err"] / a["max_x"] if a["max_x"] else 0.0,
            "mean_rel": a["sum_err"] / a["sum_x"] if a["sum_x"] else 0.0,
        }
        if prev is not None and a["sum_upd"]:
            r["mean_err_over_update"] = a["sum_err"] / a["sum_upd"]
        if "sqrt_sum_x" in a:
            r["sqrt_max_rel"] = a["sqrt_max_err"] / a["sqrt_max_x"] if a["sqrt_max_x"] else 0.0
            r["sqrt_mean_rel"] = a["sqrt_sum_err"] / a["sqrt_sum_x"] if a["sqrt_sum_x"] else 0.0
        res[k] = r
    return res


@dataclass
class Case:
    variant: str
    entries: list[TensorEntry]
    kinds: list[str]
    prev: np.ndarray[Any, Any]
    cur: np.ndarray[Any, Any]
    segs: list[Segment]
    lossy_segs: list[Segment]


def build_case(variant: str, prev_t: list[torch.Tensor], cur_t: list[torch.Tensor], kinds: list[str]) -> Case:
    entries, cur = layout(variant_tensors(cur_t, kinds, variant))
    _, prev = layout(variant_tensors(prev_t, kinds, variant))
    marks = {
        i: ("sqrt" if k == "exp_avg_sq" else "linear")
        for i, k in enumerate(kinds)
        if k in ("param", "exp_avg", "exp_avg_sq")
    }
    return Case(
        variant=variant,
        entries=entries,
        kinds=kinds,
        prev=prev,
        cur=cur,
        segs=segments_for(entries, len(cur)),
        lossy_segs=segments_for(entries, len(cur), marks),
    )


def measure(case: Case, mode: str, method: str, reps: int, chunk_bytes: int, threads: int) -> dict[str, Any]:
    engine = make_engine(method, chunk_bytes)
    lossy = method.startswith("lossy-")
    segs = case.lossy_segs if lossy else case.segs
    raw = case.cur
    base: np.ndarray[Any, Any] | None = None
    if mode == "delta":
        base = case.prev
        if method.endswith("-chain"):  # the reader's base: step k as a lossy full encode decodes it
            full = engine.encode(case.prev, segs, None, 1)
            base = np.empty_like(case.prev)
            engine.decode(full, base, None)
            del full
    n = len(raw)
    gc.collect()
    # Warm-up on a prefix (imports, thread-local scratch buffers), not timed.
    head, warm = 0, []
    for s in segs:
        if s.offset >= 8 * chunk_bytes:
            break
        n_s = min(s.length, 8 * chunk_bytes - s.offset) // s.typesize * s.typesize
        warm.append(dataclasses.replace(s, length=n_s))
        head = s.offset + n_s
        if n_s < s.length:
            break
    engine.encode(raw[:head], warm, None if base is None else base[:head], 1)
    runs: dict[str, list[float]] = {"enc_wall_1t": [], "enc_cpu_1t": [], "enc_wall_nt": [], "dec_wall": []}
    out = np.empty_like(raw)
    for _ in range(reps):
        chunks, w, c = _timed(lambda: engine.encode(raw, segs, base, 1))
        runs["enc_wall_1t"].append(w)
        runs["enc_cpu_1t"].append(c)
        _, w, _ = _timed(lambda: engine.encode(raw, segs, base, threads))
        runs["enc_wall_nt"].append(w)
        _, w, _ = _timed(lambda c=chunks: engine.decode(c, out, base))
        runs["dec_wall"].append(w)
    enc = engine.enc_bytes(chunks)

    def mbps(key: str) -> float:
        return n / statistics.median(runs[key]) / 1e6

    res: dict[str, Any] = {
        "variant": case.variant,
        "mode": mode,
        "method": method,
        "codec": engine.cfg.describe() if isinstance(engine, CodecEngine) else method,
        "raw_bytes": n,
        "enc_bytes": enc,
        "ratio": n / enc,
        "encode_mbps_per_core": mbps("enc_cpu_1t"),
        "encode_mbps_1t": mbps("enc_wall_1t"),
        f"encode_mbps_{threads}t": mbps("enc_wall_nt"),
        "decode_mbps": mbps("dec_wall"),
        "runs_s": runs,
    }
    if isinstance(engine, CodecEngine):
        used: dict[str, int] = {}
        for info, _ in chunks:
            used[info.codec] = used.get(info.codec, 0) + info.length
        res["chunk_codecs_bytes"] = used
    if lossy:
        res["lossy_error"] = lossy_errors(
            case.entries, case.kinds, raw, out, case.prev if mode == "delta" else None
        )
        res["roundtrip_ok"] = None
        res["lossless_bytes_exact"] = all(
            out[s.offset : s.offset + s.length].tobytes() == raw[s.offset : s.offset + s.length].tobytes()
            for s in segs
            if s.lossy is None
        )
    else:
        res["roundtrip_ok"] = bool(np.array_equal(out, raw))
    return res


# --------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    def ver(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            None,
        )
        if Path("/proc/cpuinfo").exists()
        else None,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "blosc2": ver("blosc2"),
        "zstandard": ver("zstandard"),
        "lz4": ver("lz4"),
        "zlib_runtime": zlib.ZLIB_RUNTIME_VERSION,
    }


def goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    def find(variant: str, mode: str, method: str) -> dict[str, Any] | None:
        return next(
            (r for r in results if (r["variant"], r["mode"], r["method"]) == (variant, mode, method)), None
        )

    out: dict[str, Any] = {}
    for variant, goal in (("fp32", GOALS["fp32_delta_ratio"]), ("bf16", GOALS["bf16_delta_ratio"])):
        for method in ("zstd1+shuffle", "zstd1+shuffle+sub"):
            r = find(variant, "delta", method)
            if r is not None:
                out[f"{variant}_delta_{method}"] = {
                    "ratio": r["ratio"],
                    "ratio_goal": goal,
                    "ratio_met": r["ratio"] >= goal,
                    "mbps_per_core": r["encode_mbps_per_core"],
                    "mbps_goal": GOALS["mbps_per_core"],
                    "mbps_met": r["encode_mbps_per_core"] >= GOALS["mbps_per_core"],
                }
    for method in (*LOSSY, "lossy-q8-chain", "lossy-q4-chain"):
        r = find("fp32", "delta", method)
        if r is not None:
            out[f"fp32_delta_{method}"] = {
                "ratio": r["ratio"],
                "ratio_goal": GOALS["lossy_delta_ratio"],
                "ratio_met": r["ratio"] >= GOALS["lossy_delta_ratio"],
            }
    return out


def print_table(results: list[dict[str, Any]], threads: int, write: Callable[[str], None] = print) -> None:
    write(
        f"{'variant':<5} {'mode':<5} {'method':<18} {'ratio':>6} {'enc/core':>9} {'enc 1t':>8} "
        f"{f'enc {threads}t':>8} {'dec':>8}  ok"
    )
    for r in results:
        ok = r["roundtrip_ok"] if r["roundtrip_ok"] is not None else "lossy"
        write(
            f"{r['variant']:<5} {r['mode']:<5} {r['method']:<18} {r['ratio']:>6.3f} "
            f"{r['encode_mbps_per_core']:>9.0f} {r['encode_mbps_1t']:>8.0f} "
            f"{r[f'encode_mbps_{threads}t']:>8.0f} {r['decode_mbps']:>8.0f}  {ok}"
        )
    write("(MB/s; enc/core = bytes per CPU-second with 1 thread; others wall-clock)")
    for r in results:
        for kind, e in r.get("lossy_error", {}).items():
            extra = "".join(f" {k}={v:.2e}" for k, v in e.items() if k not in ("max_rel", "mean_rel"))
            write(
                f"  {r['variant']} {r['mode']} {r['method']} {kind:<10} max_rel={e['max_rel']:.2e} "
                f"mean_rel={e['mean_rel']:.2e}{extra}"
            )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="tiny preset, 6 steps, 1 rep (smoke test)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model preset (default medium)")
    ap.add_argument("--steps", type=int, default=None, help="training steps; k = steps - 1 (default 60)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (the demo's default)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions, median reported (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the multi-threaded encode figure")
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--variants", default="fp32,bf16")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the methods")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="trained-state cache")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.preset = args.preset or "tiny"
        args.steps = args.steps or 6
        args.reps = args.reps or 1
    args.preset = args.preset or "medium"
    args.steps = args.steps or 60
    args.reps = args.reps or 3
    if args.steps < 1 or args.reps < 1 or args.threads < 1:
        ap.error("--steps, --reps and --threads must be >= 1")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variant_list:
        if v not in ("fp32", "bf16"):
            ap.error(f"unknown variant {v!r}; choose from fp32, bf16")
    all_methods = (*LOSSLESS, *DELTA_ONLY, *LOSSY)
    args.method_list = (
        list(all_methods) if args.methods is None else [m.strip() for m in args.methods.split(",")]
    )
    for m in args.method_list:
        if m not in all_methods:
            ap.error(f"unknown method {m!r}; choose from {', '.join(all_methods)}")
    if args.out is None:
        args.out = RESULTS / ("encode-quick.json" if args.quick else "encode.json")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    print(f"[bench] training {args.preset} for {args.steps} steps (or loading the cache) ...", flush=True)
    prev_t, cur_t, kinds, facts = trained_pair(
        args.preset, args.steps, args.batch, args.lr, None if args.no_cache else args.cache_dir
    )
    results: list[dict[str, Any]] = []
    workload: dict[str, Any] = {"training": facts, "variants": {}}
    for variant in args.variant_list:
        case = build_case(variant, prev_t, cur_t, kinds)
        by_kind: dict[str, int] = {}
        for e, k in zip(case.entries, kinds, strict=True):
            by_kind[k] = by_kind.get(k, 0) + e.nbytes
        workload["variants"][variant] = {
            "data_len": len(case.cur),
            "num_tensors": len(case.entries),
            "bytes_by_kind": by_kind,
            "segments": len(case.segs),
            "lossy_segments": len(case.lossy_segs),
        }
        for mode in ("full", "delta"):
            for method in args.method_list:
                if mode == "full" and method in DELTA_ONLY:
                    continue
                print(f"[bench] {variant} {mode} {method} ...", flush=True)
                r = measure(case, mode, method, args.reps, args.chunk_bytes, args.threads)
                results.append(r)
                print_table([r], args.threads, write=lambda s: print("   ", s))
        del case
        gc.collect()
    report = {
        "benchmark": "encode",
        "what": "ratio and speed of snapshot-byte encoding (nonstop.snapshot.codec) on a trained state",
        "notes": [
            "ratio = raw data bytes / payload bytes (chunk manifests excluded).",
            "encode_mbps_per_core: raw bytes / process CPU seconds of a 1-thread encode; the other "
            "figures are wall-clock, so they move with other load on the machine.",
            "Each figure is the median of `reps` repetitions after one untimed warm-up encode.",
            "Codec methods include per-chunk zlib.crc32 of the raw and encoded bytes; plain-* methods "
            "do the same chunking, XOR and crc32 around zstandard/lz4.block without shuffle.",
            "bf16 variant: params and Adam moments cast to bfloat16 from the fp32 run (steps k, k+1); "
            "step counters stay float32.",
            "lossy-q* delta: the base is the exact step k (a lossless full base); lossy-q*-chain: the "
            "base is step k encoded full with the same lossy setting and decoded. Errors are against "
            "the exact step k+1.",
            "lossy errors: max_rel = max|y-x| / max|x|, mean_rel = mean|y-x| / mean|x| per tensor kind; "
            "sqrt_* the same for sqrt(exp_avg_sq); mean_err_over_update = mean|y-x| / mean|x - x_k|.",
        ],
        "machine": machine_info(),
        "config": {
            "preset": args.preset,
            "steps": args.steps,
            "batch": args.batch,
            "lr": args.lr,
            "reps": args.reps,
            "threads": args.threads,
            "chunk_bytes": args.chunk_bytes,
            "variants": args.variant_list,
            "methods": args.method_list,
            "quick": args.quick,
        },
        "workload": workload,
        "goals": goals(results),
        "total_s": time.perf_counter() - t0,
        "results": results,
    }
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n[bench] total {report['total_s']:.1f} s; wrote {out}")
    print_table(results, args.threads)
    for name, g in report["goals"].items():
        print(
            f"[goal] {name}: "
            + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in g.items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
