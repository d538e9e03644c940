"""A mutation fuzzer over every decoder of snapshot bytes from disk, shared memory or a peer.

What is measured
----------------
Issue 17, item 6: whatever the bytes, each decoder returns a correct decode or raises
:class:`~nonstop.errors.SnapshotCorruptError` (:class:`~nonstop.errors.SnapshotMissingError`
where "no snapshot" is the answer), and it allocates nothing a length field claims before the
field is checked. This script feeds ``--inputs`` inputs (split over the decoders by
:data:`WEIGHTS`) and counts, per decoder:

* ``decoded`` / ``rejected``: correct decodes and the project's error;
* ``crashes``: any other exception (the first few are kept, with the input, in ``examples``);
* ``wrong``: a decode that returned bytes other than the original where the original is known
  (chunks decoded in place, a durable load);
* ``max_alloc_bytes``: the largest peak of Python-visible allocation (``tracemalloc``: Python
  objects, ``bytearray``, numpy arrays; not torch's own) while decoding one input, over a sample
  of every ``--alloc-every``-th input (tracing slows decoding ~3x, so it is sampled).

Inputs are valid encodings mutated in plain Python with a seeded ``random.Random`` per input
(``--seed``; input ``i`` of decoder ``d`` is the same on every run): bit flips, truncations,
spliced, duplicated or zeroed ranges, 1/2/4/8-byte words overwritten with extreme values, and
JSON values replaced (huge, negative, wrong type, nested 10,000 deep), removed or nudged by
+-1/8/64 -- with the manifest's CRC-32, or a chunk's payload CRC-32C, recomputed in part of the
inputs so that the mutation reaches the decoder behind the checksum -- plus some purely random
inputs. No coverage guidance (no atheris).

Decoders: ``chunk_info`` (``ChunkInfo.from_json``), ``decode_chunk`` (from_json, then
``check_sizes``, then ``decode_chunk``: the order a reader uses), ``decode`` (a whole buffer from
a mutated chunk list), ``decode_manifest``, ``durable_load`` (``DurableStore.load()`` over a
checkpoint whose newest manifest or chunk file is mutated: it must return an intact checkpoint),
``decode_raw`` (a snapshot's meta and data), ``decode_dtensor`` (a sharded tensor's tree node),
``slot`` (a shared-memory slot file's header or meta mutated, then a replacement
``RankSnapshotStore`` lists, reads and copies out what it can and writes a new snapshot).

How to run
----------
::

    .venv/bin/python benchmarks/bench_fuzz.py --inputs 1000000 --seed 1   # ~3.5 min on 2 cores
    .venv/bin/python benchmarks/bench_fuzz.py --inputs 2000              # smoke

Results go to ``benchmarks/results/fuzz.json`` (``--json`` overrides); a table is printed. The
exit status is 1 when any input crashed a decoder or was decoded wrong.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fuzzinputs import (
    DT_NODE,
    ENTRIES,
    RAW,
    Encoding,
    canonical,
    encodings,
    floats,
    json_bytes,
    mutate_bytes,
    mutate_json,
    nasty_value,
    resigned,
    snapshot_meta,
)

from nonstop.errors import SnapshotCorruptError, SnapshotMissingError
from nonstop.snapshot import RankSnapshotStore
from nonstop.snapshot.api import HEADER_FMT, HEADER_SIZE
from nonstop.snapshot.codec import (
    ChunkInfo,
    CodecConfig,
    Encoder,
    check_sizes,
    checksum,
    decode,
    decode_chunk,
    segments_for,
)
from nonstop.snapshot.durable import MANIFEST, DurableStore, step_dir
from nonstop.snapshot.durable.format import decode_manifest
from nonstop.snapshot.sharded import decode_dtensor
from nonstop.snapshot.store import decode_raw, slot_path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

WEIGHTS = {
    "chunk_info": 0.12,
    "decode_chunk": 0.25,
    "decode": 0.08,
    "decode_manifest": 0.18,
    "durable_load": 0.04,
    "decode_raw": 0.14,
    "decode_dtensor": 0.12,
    "slot": 0.07,
}
"""Share of the inputs each decoder gets."""

MAX_OUT = 64 << 20  # a reader allocates what check_sizes let through; the fuzzer caps it
EXAMPLES_KEPT = 5  # crash examples kept per decoder


# ---------------------------------------------------------------------------- targets
class Target:
    """One decoder: ``run(rng)`` makes an input, calls :meth:`begin` with it, decodes it and
    returns what the decode was (``"wrong"`` for a wrong one); the project's errors (``allowed``)
    mean "rejected", anything else is a crash."""

    name = ""
    allowed: tuple[type[BaseException], ...] = (SnapshotCorruptError,)

    def __init__(self) -> None:
        self.last_input = ""
        self.trace = False  # trace the allocations of this input's decoding

    def setup(self, work: Path) -> None:
        pass

    def run(self, rng: random.Random) -> str:
        raise NotImplementedError

    def begin(self, *parts: Any) -> None:
        """The input is made (``parts`` describe it, for crash reports): what follows is the
        decoder's work, whose allocations are traced when this input is sampled."""
        self.last_input = " | ".join(p.hex()[:400] if isinstance(p, bytes) else repr(p)[:400] for p in parts)
        if self.trace:
            tracemalloc.start()


class ChunkInfoTarget(Target):
    name = "chunk_info"

    def setup(self, work: Path) -> None:
        self.docs = [info.to_json() for enc in ENCODINGS.values() for info, _ in enc.chunks]

    def run(self, rng: random.Random) -> str:
        doc = mutate_json(rng.choice(self.docs), rng) if rng.random() < 0.9 else nasty_value(rng)
        self.begin(doc)
        ChunkInfo.from_json(doc)
        return "decoded"


class DecodeChunkTarget(Target):
    name = "decode_chunk"

    def setup(self, work: Path) -> None:
        self.cases = [(e, i) for e in ENCODINGS.values() for i in range(len(e.chunks))]

    def run(self, rng: random.Random) -> str:
        enc, i = rng.choice(self.cases)
        info0, payload = enc.chunks[i]
        doc = info0.to_json()
        kind = rng.choices(
            ["payload", "flips-resigned", "payload-resigned", "info", "both"], [1, 4, 2, 1.5, 1.5]
        )[0]
        if kind == "flips-resigned":  # the frame stays whole: the decompressor meets the damage
            bad = bytearray(payload)
            for _ in range(rng.randint(1, 8)):
                bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
            payload = bytes(bad)
        elif kind != "info":
            payload = mutate_bytes(payload, rng)
        if kind in ("flips-resigned", "payload-resigned") or (kind == "both" and rng.random() < 0.5):
            doc = {**doc, "crc_enc": checksum(payload), "enc_len": len(payload)}
        if kind in ("info", "both"):
            doc = mutate_json(doc, rng)
        self.begin(doc, payload)
        info = ChunkInfo.from_json(doc)
        check_sizes(info, payload)
        if info.length > MAX_OUT:
            return "sizes consistent, too large to decode here"
        out = bytearray(info.length)
        decode_chunk(info, payload, memoryview(out), enc.base)
        if (info.offset, info.length, info.crc_raw) == (info0.offset, info0.length, info0.crc_raw):
            if bytes(out) != enc.expected[info0.offset : info0.offset + info0.length]:
                return "wrong"
        return "decoded" if checksum(out) == info.crc_raw else "wrong"


class DecodeTarget(Target):
    name = "decode"

    def run(self, rng: random.Random) -> str:
        enc = rng.choice(list(ENCODINGS.values()))
        chunks = list(enc.chunks)
        for _ in range(rng.randint(1, 3)):
            kind = rng.randrange(4)
            j = rng.randrange(len(chunks)) if chunks else 0
            if kind == 0 and chunks:
                del chunks[j]
            elif kind == 1 and chunks:
                chunks.insert(j, chunks[j])
            elif kind == 2 and len(chunks) > 1:
                k = rng.randrange(len(chunks))
                chunks[j], chunks[k] = (chunks[j][0], chunks[k][1]), (chunks[k][0], chunks[j][1])
            elif chunks:
                payload = mutate_bytes(chunks[j][1], rng)
                doc = {**chunks[j][0].to_json(), "crc_enc": checksum(payload), "enc_len": len(payload)}
                chunks[j] = (
                    ChunkInfo.from_json(mutate_json(doc, rng) if rng.random() < 0.5 else doc),
                    payload,
                )
        self.begin([c[0].to_json() for c in chunks])
        out = bytearray(len(RAW))
        decode(chunks, out, enc.base)
        return "decoded" if bytes(out) == enc.expected else "wrong"


class ManifestTarget(Target):
    name = "decode_manifest"

    def setup(self, work: Path) -> None:
        self.good = (DURABLE_ROOT / step_dir(20) / MANIFEST).read_bytes()
        self.doc = json.loads(self.good)

    def run(self, rng: random.Random) -> str:
        kind = rng.randrange(10)
        if kind < 4:
            raw = mutate_bytes(self.good, rng)
        elif kind < 9:
            raw = resigned(mutate_json(self.doc, rng))
        else:
            raw = rng.randbytes(rng.randrange(512))
        self.begin(raw)
        decode_manifest(raw, "fuzz")
        return "decoded"


class DurableLoadTarget(Target):
    name = "durable_load"
    allowed = (SnapshotCorruptError, SnapshotMissingError)

    def setup(self, work: Path) -> None:
        self.root = work / "ckpt"
        shutil.copytree(DURABLE_ROOT, self.root)
        self.files = {
            p: p.read_bytes()
            for p in (self.root / step_dir(20) / MANIFEST, self.root / step_dir(20) / "rank-00000.bin")
        }

    def run(self, rng: random.Random) -> str:
        path = rng.choice(sorted(self.files))
        good = self.files[path]
        if path.name == MANIFEST and rng.random() < 0.6:
            bad = resigned(mutate_json(json.loads(good), rng))
        else:
            bad = mutate_bytes(good, rng)
        self.begin(path.name, bad)
        path.write_bytes(bad)
        try:
            ck = DurableStore(self.root).load()
        finally:
            path.write_bytes(good)
        if ck.step not in (10, 20) or bytes(ck.data(0)) != floats(len(RAW), ck.step):
            return "wrong"
        return "loaded step 20" if ck.step == 20 else "fell back to step 10"


class DecodeRawTarget(Target):
    name = "decode_raw"

    def setup(self, work: Path) -> None:
        self.meta, self.data = snapshot_meta()
        self.doc = json.loads(self.meta)

    def run(self, rng: random.Random) -> str:
        meta, data = self.meta, self.data
        kind = rng.randrange(10)
        if kind < 5:
            meta = json_bytes(mutate_json(self.doc, rng))
        elif kind < 8:
            meta = mutate_bytes(meta, rng)
        elif kind < 9:
            data = mutate_bytes(data, rng)
        else:
            meta, data = rng.randbytes(rng.randrange(256)), rng.randbytes(rng.randrange(256))
        self.begin(meta, len(data))
        decode_raw(meta, bytearray(data))
        return "decoded"


class DTensorTarget(Target):
    name = "decode_dtensor"

    def setup(self, work: Path) -> None:
        self.tensors = [torch.zeros(2, 2)]

    def run(self, rng: random.Random) -> str:
        node = mutate_json(DT_NODE, rng)
        self.begin(node)
        if isinstance(node, dict):
            decode_dtensor(node, self.tensors)
        return "decoded"


class SlotTarget(Target):
    name = "slot"
    allowed = (SnapshotCorruptError, SnapshotMissingError)

    def setup(self, work: Path) -> None:
        self.shm = work / "shm"
        self.shm.mkdir()
        store = RankSnapshotStore(shm_dir=self.shm, job_id="fz", rank=0, num_slots=2)
        store.write(1, {"w": torch.arange(64.0)})
        store.write(2, {"w": torch.arange(64.0) + 1})
        store.close()
        self.paths = [slot_path(self.shm, "fz", 0, i) for i in range(2)]
        self.good = [p.read_bytes() for p in self.paths]

    def run(self, rng: random.Random) -> str:
        for p, g in zip(self.paths, self.good, strict=True):
            p.write_bytes(g)
        victim = rng.randrange(2)
        raw = bytearray(self.good[victim])
        kind = rng.randrange(3)
        if kind == 0:  # header bytes
            raw[:HEADER_SIZE] = mutate_bytes(bytes(raw[:HEADER_SIZE]), rng).ljust(HEADER_SIZE, b"\0")[
                :HEADER_SIZE
            ]
        elif kind == 1:  # header fields set to extreme values
            fields = list(struct.unpack_from(HEADER_FMT, raw))
            for _ in range(rng.randint(1, 3)):
                k = rng.randrange(1, len(fields))
                fields[k] = _field_value(k, rng)
            struct.pack_into(HEADER_FMT, raw, 0, *fields)
        else:  # the meta behind a valid header
            meta_at = HEADER_SIZE + struct.unpack_from(HEADER_FMT, raw)[6]
            end = min(len(raw), meta_at + 256)
            raw[meta_at:end] = mutate_bytes(bytes(raw[meta_at:end]), rng).ljust(end - meta_at, b"\0")[
                : end - meta_at
            ]
        self.paths[victim].write_bytes(bytes(raw))
        self.begin(victim, bytes(raw[:96]))
        store = RankSnapshotStore(shm_dir=self.shm, job_id="fz", rank=0, num_slots=2)
        try:
            steps = store.complete_steps()
            read = 0
            for step in steps:
                try:
                    store.read(step)
                    store.copy_out(step).entries()
                    read += 1
                except (SnapshotCorruptError, SnapshotMissingError):
                    pass
            # The rank writes on (never wedged) -- a step no bit flip of 1 or 2 makes, since a
            # forged header claiming the same step with a later write time would be trusted.
            store.write(NEW_STEP, {"w": torch.full((64,), 9.0)})
            if not torch.equal(store.read(NEW_STEP)["w"], torch.full((64,), 9.0)):
                return "wrong"
        finally:
            store.close()
        return f"{len(steps)} steps listed, {read} read; wrote on"


NEW_STEP = 0x5A5A_0F0F


_FIELD_CODES = [c for c in HEADER_FMT.lstrip("<") if not c.isdigit()]


def _field_value(k: int, rng: random.Random) -> Any:
    c = _FIELD_CODES[k]
    if c == "d":
        return rng.choice([0.0, -1.0, 1e300, float("inf"), float("nan")])
    bits = 32 if c in "Ii" else 64
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if c in "iq" else (0, 2**bits - 1)
    return max(lo, min(hi, rng.choice([0, 1, 2, 3, 7, 64, 4096, 2**31, 2**40, -1, lo, hi])))


TARGETS: list[type[Target]] = [
    ChunkInfoTarget,
    DecodeChunkTarget,
    DecodeTarget,
    ManifestTarget,
    DurableLoadTarget,
    DecodeRawTarget,
    DTensorTarget,
    SlotTarget,
]


# ---------------------------------------------------------------------------- the run
@dataclass
class Tally:
    inputs: int = 0
    decoded: int = 0
    rejected: int = 0
    crashes: int = 0
    wrong: int = 0
    seconds: float = 0.0
    alloc_sampled: int = 0
    max_alloc_bytes: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)  # what the decodes were
    reasons: Counter[str] = field(default_factory=Counter)  # why inputs were rejected


def reason(e: BaseException) -> str:
    """A rejection's message with the numbers and the chunk's name taken out: what check
    stopped the input (how far into the decoder it got)."""
    msg = " ".join(str(e).split())
    msg = re.sub(r"^chunk at offset \d+ \(\+\d+ bytes, [^)]*\): ", "chunk: ", msg)
    msg = msg.split("; ")[0]  # what happens next
    return re.sub(r"-?\d+", "N", msg)[:100].strip()


def run_target(target: Target, n: int, seed: int, alloc_every: int, tally: Tally) -> None:
    t0 = time.perf_counter()
    for i in range(n):
        rng = random.Random(f"{seed}:{target.name}:{i}")
        target.trace = alloc_every > 0 and i % alloc_every == 0
        try:
            outcome = target.run(rng)
        except target.allowed as e:
            tally.rejected += 1
            tally.reasons[reason(e)] += 1
        except Exception as e:  # a crash: the decoder let something else escape
            tally.crashes += 1
            if len(tally.examples) < EXAMPLES_KEPT:
                tally.examples.append(
                    {
                        "index": i,
                        "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
                        "input": target.last_input,
                    }
                )
        else:
            if outcome == "wrong":
                tally.wrong += 1
                if len(tally.examples) < EXAMPLES_KEPT:
                    tally.examples.append({"index": i, "error": "wrong decode", "input": target.last_input})
            else:
                tally.decoded += 1
                tally.outcomes[outcome] += 1
        finally:
            if tracemalloc.is_tracing():
                tally.alloc_sampled += 1
                tally.max_alloc_bytes = max(tally.max_alloc_bytes, tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
        tally.inputs += 1
    tally.seconds = time.perf_counter() - t0


def split(total: int, only: list[str]) -> dict[str, int]:
    """Inputs per decoder: ``total`` split by :data:`WEIGHTS` (each selected decoder >= 1)."""
    weights = {k: v for k, v in WEIGHTS.items() if k in only}
    norm = sum(weights.values())
    counts = {k: max(1, int(total * w / norm)) for k, w in weights.items()}
    biggest = max(counts, key=lambda k: counts[k])
    counts[biggest] += max(0, total - sum(counts.values()))
    return counts


def build_durable_root(root: Path) -> None:
    """Two one-rank checkpoints (steps 10 and 20) under ``root``."""
    store = DurableStore(root, keep=5)
    for step in (10, 20):
        cfg = CodecConfig(chunk_bytes=4096)
        meta = canonical(
            {"tree": {"w": {"__t__": 0}, "step": step}, "tensors": [e.to_json() for e in ENTRIES]}
        )
        data = floats(len(RAW), step)
        writer = store.begin(step, 1, cfg.describe())
        with Encoder(cfg) as enc:
            writer.add_rank(0, meta, len(data), enc.encode(data, segments_for(ENTRIES, len(data))), None)
        writer.commit()


def machine_info() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "commit": commit or None,
    }


ENCODINGS: dict[str, Encoding] = {}
DURABLE_ROOT = Path()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--inputs", type=int, default=1_000_000, help="inputs in total, over all decoders")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=RESULTS / "fuzz.json", help="where the report goes")
    ap.add_argument("--alloc-every", type=int, default=100, help="trace allocation of every Nth input")
    ap.add_argument("--only", default=",".join(WEIGHTS), help="comma-separated subset of the decoders")
    args = ap.parse_args(argv)
    args.only_list = [d for d in args.only.split(",") if d]
    unknown = set(args.only_list) - set(WEIGHTS)
    if unknown or args.inputs < 1:
        ap.error(
            f"unknown decoders {sorted(unknown)} (know {sorted(WEIGHTS)})" if unknown else "--inputs >= 1"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    global DURABLE_ROOT
    args = parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("nonstop").setLevel(logging.ERROR)  # one warning per corrupt input otherwise
    t0 = time.perf_counter()
    counts = split(args.inputs, args.only_list)
    tallies: dict[str, Tally] = {}
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="nonstop-fuzz-", dir=shm_parent) as tmp:
        work = Path(tmp)
        ENCODINGS.update(encodings())
        DURABLE_ROOT = work / "pristine"
        build_durable_root(DURABLE_ROOT)
        for cls in TARGETS:
            target = cls()
            if target.name not in counts:
                continue
            (work / target.name).mkdir()
            target.setup(work / target.name)
            tally = tallies[target.name] = Tally()
            print(f"[fuzz] {target.name}: {counts[target.name]} inputs ...", flush=True)
            run_target(target, counts[target.name], args.seed, args.alloc_every, tally)
            print(
                f"    {tally.inputs} inputs in {tally.seconds:.1f} s: {tally.decoded} decoded, "
                f"{tally.rejected} rejected, {tally.crashes} crashes, {tally.wrong} wrong, "
                f"max traced allocation {tally.max_alloc_bytes} B",
                flush=True,
            )
    total = {
        "inputs": sum(t.inputs for t in tallies.values()),
        "crashes": sum(t.crashes for t in tallies.values()),
        "wrong": sum(t.wrong for t in tallies.values()),
        "seconds": time.perf_counter() - t0,
    }
    report = {
        "benchmark": "fuzz",
        "what": "mutation fuzzing of every decoder of snapshot bytes (issue 17, item 6)",
        "command": " ".join([Path(sys.executable).name, "benchmarks/bench_fuzz.py", *(argv or sys.argv[1:])]),
        "notes": [
            "decoded: a correct decode; rejected: SnapshotCorruptError (or SnapshotMissingError for "
            "durable_load and slot); crashes: any other exception; wrong: a decode that returned "
            "other bytes than the original where the original is known.",
            "max_alloc_bytes: peak tracemalloc-traced allocation while decoding one input, over every "
            "alloc_every-th input (Python objects, bytearray, numpy; not torch's own allocations).",
            "Input i of decoder d comes from random.Random(f'{seed}:{d}:{i}'): reproducible per input.",
        ],
        "machine": machine_info(),
        "config": {
            "inputs": args.inputs,
            "seed": args.seed,
            "alloc_every": args.alloc_every,
            "weights": WEIGHTS,
        },
        "total": total,
        "decoders": {
            name: {
                "inputs": t.inputs,
                "decoded": t.decoded,
                "rejected": t.rejected,
                "crashes": t.crashes,
                "wrong": t.wrong,
                "seconds": round(t.seconds, 3),
                "inputs_per_s": round(t.inputs / max(t.seconds, 1e-9), 1),
                "alloc_sampled": t.alloc_sampled,
                "max_alloc_bytes": t.max_alloc_bytes,
                "outcomes": dict(t.outcomes.most_common()),
                "top_rejections": dict(t.reasons.most_common(12)),
                "examples": t.examples,
            }
            for name, t in tallies.items()
        },
    }
    out: Path = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n[fuzz] {total['inputs']} inputs in {total['seconds']:.1f} s; wrote {out}")
    head = ("decoder", "inputs", "decoded", "rejected", "crashes", "wrong", "max alloc")
    print(f"{head[0]:<16}{head[1]:>10}{head[2]:>10}{head[3]:>10}{head[4]:>9}{head[5]:>7}{head[6]:>12}")
    for name, t in tallies.items():
        print(
            f"{name:<16}{t.inputs:>10}{t.decoded:>10}{t.rejected:>10}{t.crashes:>9}{t.wrong:>7}"
            f"{t.max_alloc_bytes:>12}"
        )
    return 1 if total["crashes"] or total["wrong"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
