"""python compare.py REF RUN [RUN...]: is every full-name tensor (params and AdamW state) of every
rank bitwise equal to REF's? Also works across pp sizes (compares the union of names)."""
import json, sys
from pathlib import Path

def load(d):
    out, steps = {}, set()
    for f in sorted(Path(d).glob("rank*.json")):
        if f.name.endswith(".killed.json"):
            continue
        j = json.loads(f.read_text())
        out.update(j["digest"]); steps.add(j["step"])
    return out, steps

ref, rs = load(sys.argv[1])
for d in sys.argv[2:]:
    got, s = load(d)
    same = got == ref
    diff = [k for k in ref if got.get(k) != ref[k]]
    print(f"{d}: {'BITWISE EQUAL' if same else 'DIFFERENT'} ({len(ref)} tensors, steps {sorted(rs)} vs {sorted(s)}; {len(diff)} differ {diff[:3]})")
