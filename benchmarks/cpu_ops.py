"""The CPU measurements behind ops/linear.py and the paged-attention gather, reproducible:

    python -m benchmarks.cpu_ops --output-json bench-results/cpu-ops.json

- read bandwidth (a `sum` over 512 MB): the floor of a decode step that reads every weight;
- 60 weight matrices of 3072x576 (about a SmolLM2-135M step's MLP weights) times 1-64 rows,
  through `F.linear` (MKL sgemm) and through oneDNN over a pre-packed weight;
- for how many batch sizes a row's result differs from the same row computed alone;
- gathering 8 requests' 7 KV blocks by advanced indexing against `index_select`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from clients.bench.environment import environment
from ops.linear import PackedLinear, can_pack


def _ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1000


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    assert can_pack(torch.device("cpu"), torch.float32), "this torch has no oneDNN"
    g = torch.Generator().manual_seed(0)

    big = torch.ones(128 * 1024 * 1024)  # 512 MB
    read_gbs = big.numel() * 4 / _ms(big.sum, args.repeat) / 1e6
    del big

    ws = [torch.randn(3072, 576, generator=g) for _ in range(60)]
    packed = [PackedLinear(w) for w in ws]
    mb = sum(w.numel() for w in ws) * 4 / 1e6
    linear = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 576, generator=g)
        a = _ms(lambda x=x: [F.linear(x, w) for w in ws], args.repeat)
        b = _ms(lambda x=x: [p(x) for p in packed], args.repeat)
        linear.append({"rows": rows, "f_linear_ms": round(a, 1), "onednn_packed_ms": round(b, 1),
                       "f_linear_gbs": round(mb / a, 1), "onednn_gbs": round(mb / b, 1)})

    x = torch.randn(512, 576, generator=g)
    sizes = [2, 3, 5, 8, 16, 17, 33, 64, 100, 257, 512]
    differ = {"f_linear": sum(not torch.equal(F.linear(x[:m], ws[0])[:1], F.linear(x[:1], ws[0]))
                              for m in sizes),
              "onednn_packed": sum(not torch.equal(packed[0](x[:m])[:1], packed[0](x[:1])) for m in sizes),
              "batch_sizes_tried": len(sizes)}

    cache = torch.randn(2000, 16, 3, 64, generator=g)
    tables = torch.randint(0, 2000, (8, 7), generator=g, dtype=torch.int32)
    gather = {"advanced_indexing_us": round(_ms(lambda: cache[tables.long()], 50) * 1000, 1),
              "index_select_us": round(_ms(lambda: cache.index_select(0, tables.reshape(-1)), 50) * 1000, 1)}

    report = {"read_bandwidth_gbs": round(read_gbs, 1), "weights_mb": round(mb, 1), "linear": linear,
              "rows_differing_from_alone": differ, "gather_8x7_blocks": gather,
              "threads": torch.get_num_threads(), "machine": environment()}
    print(f"read bandwidth {report['read_bandwidth_gbs']} GB/s; {len(ws)} weights, {mb:.0f} MB")
    print("| rows | F.linear ms (GB/s) | oneDNN packed ms (GB/s) |\n|---|---|---|")
    for r in linear:
        print(f"| {r['rows']} | {r['f_linear_ms']} ({r['f_linear_gbs']}) | "
              f"{r['onednn_packed_ms']} ({r['onednn_gbs']}) |")
    print(f"row 0 differs from itself alone at {differ['f_linear']} of {len(sizes)} batch sizes with "
          f"F.linear, {differ['onednn_packed']} with oneDNN")
    print(f"gather of 8x7 KV blocks: cache[tables] {gather['advanced_indexing_us']} us, "
          f"index_select {gather['index_select_us']} us")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
