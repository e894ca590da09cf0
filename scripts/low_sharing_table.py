"""The low-sharing grid's rows as docs/benchmarks.md prints them ("Low sharing: never slower than dense"): "vs
fastest dense" is the faster of naive and the padded batch over branchreplay, from one `bench --json` run; the
target is >= 0.95.

    .venv/bin/branchreplay bench --scenario low-sharing --methods naive,padded,branchreplay --repeats 5 \
        --threads 2 --json > /tmp/low-sharing-t2.json
    .venv/bin/python scripts/low_sharing_table.py /tmp/low-sharing-t2.json
"""

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("bench_json", help="the JSON that `branchreplay bench --json` printed")
    d = json.load(open(ap.parse_args().bench_json))
    rows = {}
    for r in d["rows"]:
        rows.setdefault((r["scenario"], r["label"]), {})[r["method"]] = r
    T = d["threads"]
    out = []
    for (sc, label), m in rows.items():
        n, p, b = m["naive"], m["padded"], m["branchreplay"]
        fastest = min(n["seconds"], p["seconds"])
        ratio = fastest / b["seconds"]
        out.append(ratio)
        print(f"| {T} | {sc} {label} | {b['token_ratio']:.2f} | {n['seconds']:.3f} | {p['seconds']:.3f} | "
              f"{b['seconds']:.3f} | {b['engine']['schedule']} | **{ratio:.2f}** |")
    print("min", round(min(out), 3), "max", round(max(out), 3), "met", sum(x >= 0.95 for x in out), "of", len(out))


if __name__ == "__main__":
    main()
