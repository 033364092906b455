#!/usr/bin/env python3
"""Compares `minilm-embed --json` output with the sentence-transformers reference.

usage: check_reference.py REFERENCE.json OUTPUT.json [MIN_COSINE]

Every reference case must appear in OUTPUT (matched by text) with identical input_ids and an
embedding whose cosine similarity with the reference is at least MIN_COSINE (default 0.9999).
Prints the per-case cosine and exits non-zero on any failure.
"""
import json
import math
import sys


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb)


def main():
    ref = json.load(open(sys.argv[1]))["cases"]
    out = {r["text"]: r for r in json.load(open(sys.argv[2]))}
    floor = float(sys.argv[3]) if len(sys.argv) > 3 else 0.9999
    ok, worst = True, 1.0
    for case in ref:
        got = out.get(case["text"])
        if got is None:
            print(f"MISSING  {case['text'][:60]!r}")
            ok = False
            continue
        ids_ok = got["input_ids"] == case["input_ids"]
        c = cosine(got["embedding"], case["embedding"])
        worst = min(worst, c)
        good = ids_ok and c >= floor and len(got["embedding"]) == len(case["embedding"])
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} 1-cos={1 - c:.2e} ids={'same' if ids_ok else 'DIFFER'} "
              f"len={len(case['input_ids'])} {case['text'][:50]!r}")
    print(f"min cosine {worst:.10f} (1-cos {1 - worst:.2e}) over {len(ref)} cases: {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
