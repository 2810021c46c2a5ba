#!/usr/bin/env python
"""Check every Triton kernel of kernels/ against its torch reference, and time it (CUDA).

    python benchmarks/gpu_kernels_check.py [--quick] [--json] [--json-out FILE]
        CUDA: correctness + timing (torch.cuda.Event, warmup) vs the bytes each op must move
        (memory-bandwidth floor at --peak-gbs, default 4800 GB/s = H200 HBM3e); the torch
        reference is timed too for comparison.
    python benchmarks/gpu_kernels_check.py --interpret [--json]
        CPU: sets TRITON_INTERPRET=1 and checks correctness only, on small odd sizes.
    python benchmarks/gpu_kernels_check.py --compile-only [--quick]
        CPU: compiles every kernel variant ahead of time for sm_90 (no GPU needed).

Each case runs in its own try/except: one failing kernel never stops the others. Exit code 0 when
every case passed, 1 otherwise, 2 when there is nothing to run (no CUDA and no CPU mode).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import time
import traceback

from benchmarks.kit import paths

paths.setup()

TOL = {"float32": (2e-4, 2e-4), "float16": (2e-2, 1e-2), "bfloat16": (6e-2, 3e-2)}  # (atol, rtol)


def _tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def build_cases(torch, K, device, small: bool, quick: bool):
    """[(name, kernel_fn, ref_fn, dtype_name, bytes_moved, exact)] built lazily (closures)."""
    g = torch.Generator(device=device).manual_seed(0)  # generate on the device: large caches

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    cases = []

    # -- pack / unpack --------------------------------------------------------------------------
    pack_shapes = [(3, 63, 8), (2, 5, 64)] if small else [(8, 8192, 128)]
    for bits in (2, 4, 3) if quick else (1, 2, 3, 4, 5, 6, 7, 8):
        for shp in pack_shapes[: 1 if quick else None]:

            def mk(bits=bits, shp=shp):
                n = shp[-1]  # 8 and 64: multiples of pad_multiple(bits) for every bits
                codes = torch.randint(0, 2**bits, shp, generator=g, device=device, dtype=torch.uint8)
                packed = K.pack_bits_ref(codes, bits)
                return codes, packed, n

            def pk(mk=mk, bits=bits):
                codes, packed, n = mk()
                return (
                    lambda: K.pack_bits(codes, bits, backend="triton"),
                    lambda: K.pack_bits(codes, bits, backend="ref"),
                    _tensor_bytes(codes, packed),
                )

            def upk(mk=mk, bits=bits):
                codes, packed, n = mk()
                return (
                    lambda: K.unpack_bits(packed, bits, n, backend="triton"),
                    lambda: K.unpack_bits(packed, bits, n, backend="ref"),
                    _tensor_bytes(codes, packed),
                )

            cases.append((f"pack b{bits} {shp}", pk, "uint8", True))
            cases.append((f"unpack b{bits} {shp}", upk, "uint8", True))

    # -- attention configs ------------------------------------------------------------------------
    if small:
        cfgs = [
            dict(B=None, Hq=6, Hkv=2, D=64, T=63, Lq=1, Lt=1),  # B=None: unbatched [H, L, D] inputs
            dict(B=2, Hq=4, Hkv=4, D=32, T=500, Lq=3, Lt=5),
            dict(B=1, Hq=9, Hkv=3, D=64, T=500, Lq=4, Lt=2),
            dict(B=1, Hq=3, Hkv=1, D=16, T=4097, Lq=2, Lt=3),
        ]
        # bfloat16 is left out here: the Triton interpreter's tl.dot is wrong for bf16 operands
        # (a 16x16 bf16 dot is off by ~1e10 under TRITON_INTERPRET=1); the CUDA run covers bf16.
        dtypes = ["float32", "float16"]
    else:
        cfgs = [
            dict(B=1, Hq=9, Hkv=3, D=64, T=8192, Lq=1, Lt=128),
            dict(B=8, Hq=9, Hkv=3, D=64, T=8192, Lq=1, Lt=128),
            dict(B=1, Hq=32, Hkv=8, D=128, T=8192, Lq=5, Lt=128),
            dict(B=8, Hq=32, Hkv=8, D=128, T=32768, Lq=1, Lt=128),
        ]
        dtypes = ["float16", "bfloat16"]
    if quick:
        cfgs = cfgs[1:3] if small else cfgs[:2]
        dtypes = dtypes[:1] if not small else dtypes

    for c in cfgs:
        for dn in dtypes:
            dt = getattr(torch, dn)
            tag = f"B{c['B'] or '-'} Hq{c['Hq']}/{c['Hkv']} D{c['D']} T{c['T']} Lq{c['Lq']} Lt{c['Lt']} {dn}"
            B, Hq, Hkv, D, T, Lq, Lt = (c[k] for k in ("B", "Hq", "Hkv", "D", "T", "Lq", "Lt"))
            B = () if B is None else (B,)

            def verify(B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, Lq=Lq, dt=dt):
                q, k, v = rnd(*B, Hq, Lq, D, dtype=dt), rnd(*B, Hkv, T, D, dtype=dt), rnd(*B, Hkv, T, D, dtype=dt)
                return (
                    lambda: K.verify_attention(q, k, v, backend="triton"),
                    lambda: K.verify_attention(q, k, v, backend="ref"),
                    _tensor_bytes(q, k, v, q),
                )

            cases.append((f"verify {tag}", verify, dn, False))

            def gathered(B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, Lq=Lq, Lt=Lt, dt=dt):
                q, k, v = rnd(*B, Hq, Lq, D, dtype=dt), rnd(*B, Hkv, T, D, dtype=dt), rnd(*B, Hkv, T, D, dtype=dt)
                kt, vt = rnd(*B, Hkv, Lt, D, dtype=dt), rnd(*B, Hkv, Lt, D, dtype=dt)
                L = max(1, T // 4)
                idx = torch.argsort(torch.rand(*B, Hkv, T, generator=g, device=device), -1)[..., :L].sort(-1).values
                kept = idx.numel() * D * k.element_size() * 2
                return (
                    lambda: K.gathered_attention(q, k, v, idx, kt, vt, backend="triton"),
                    lambda: K.gathered_attention(q, k, v, idx, kt, vt, backend="ref"),
                    kept + _tensor_bytes(q, idx, kt, vt, q),
                )

            cases.append((f"gathered 1/4 {tag}", gathered, dn, False))

            for bits in (4,) if quick else (2, 4):

                def kivi(B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, Lq=Lq, Lt=Lt, dt=dt, bits=bits):
                    grp = 32
                    tq = K.kivi_split(T, grp)
                    q = rnd(*B, Hq, Lq, D, dtype=dt)
                    kk, vv = rnd(*B, Hkv, T, D), rnd(*B, Hkv, T, D)
                    kp = K.kivi_quantize_keys(kk[..., :tq, :], bits, grp)
                    vp = K.kivi_quantize_values(vv[..., :tq, :], bits, min(grp, D))
                    kt = torch.cat([kk[..., tq:, :], rnd(*B, Hkv, Lt, D)], -2).to(dt)
                    vt = torch.cat([vv[..., tq:, :], rnd(*B, Hkv, Lt, D)], -2).to(dt)
                    kw = dict(bits=bits, k_group=grp, v_group=min(grp, D), k_tail=kt, v_tail=vt)
                    return (
                        lambda: K.kivi_decode_attention(q, *kp, *vp, backend="triton", **kw),
                        lambda: K.kivi_decode_attention(q, *kp, *vp, backend="ref", **kw),
                        _tensor_bytes(q, *kp, *vp, kt, vt, q),
                    )

                cases.append((f"kivi{bits} {tag}", kivi, dn, False))

                def turbo(B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, Lq=Lq, Lt=Lt, dt=dt, bits=bits):
                    q = rnd(*B, Hq, Lq, D, dtype=dt)
                    kp = K.turbo_quantize(rnd(*B, Hkv, T, D), bits, seed=3)
                    vp = K.turbo_quantize(rnd(*B, Hkv, T, D), bits, seed=4)  # values: own rotation
                    kt, vt = rnd(*B, Hkv, Lt, D, dtype=dt), rnd(*B, Hkv, Lt, D, dtype=dt)
                    kw = dict(bits=bits, seed=3, v_seed=4, k_tail=kt, v_tail=vt)
                    return (
                        lambda: K.turbo_decode_attention(q, *kp, *vp, backend="triton", **kw),
                        lambda: K.turbo_decode_attention(q, *kp, *vp, backend="ref", **kw),
                        _tensor_bytes(q, *kp, *vp, kt, vt, q),
                    )

                cases.append((f"turbo{bits} {tag}", turbo, dn, False))
    return cases


def _time_cuda(torch, fn, warmup=3, iters=20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3


def run_checks(args) -> list[dict]:
    import torch

    import vericache_kernels as K

    device = "cpu" if args.interpret else "cuda"
    rows = []
    for name, build, dn, exact in build_cases(torch, K, device, small=args.interpret, quick=args.quick):
        row = {"case": name, "ok": False}
        t0 = time.time()
        try:
            kern, ref, nbytes = build()
            out, want = kern(), ref()
            if exact:
                row["max_err"] = int((out.int() - want.int()).abs().max().item()) if out.numel() else 0
                row["ok"] = out.shape == want.shape and out.dtype == want.dtype and bool(torch.equal(out, want))
            else:
                atol, rtol = TOL[dn]
                err = (out.float() - want.float()).abs()
                row["max_err"] = float(err.max())
                row["ok"] = (
                    out.shape == want.shape
                    and out.dtype == want.dtype
                    and bool(torch.isfinite(out).all())
                    and bool((err <= atol + rtol * want.float().abs()).all())
                )
            row["bytes"] = nbytes
            if not args.interpret:
                tk = _time_cuda(torch, kern, iters=args.iters)
                tr = _time_cuda(torch, ref, iters=max(3, args.iters // 4))
                floor = nbytes / (args.peak_gbs * 1e9)
                row.update(
                    us=tk * 1e6,
                    ref_us=tr * 1e6,
                    floor_us=floor * 1e6,
                    gbs=nbytes / tk / 1e9,
                    pct_peak=100 * floor / tk,
                    speedup_vs_ref=tr / tk,
                )
        except Exception as e:  # keep going: GPU time is scarce
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            row["trace"] = traceback.format_exc()[-2000:]
        row["wall_s"] = round(time.time() - t0, 2)
        rows.append(row)
        if not args.json:
            _print_row(row)
    return rows


def _print_row(r):
    status = "ok  " if r["ok"] else "FAIL"
    timing = (
        (
            f"{r['us']:9.1f}us floor {r['floor_us']:8.1f}us {r['pct_peak']:5.1f}% peak "
            f"{r['gbs']:7.0f} GB/s ref {r['ref_us']:9.1f}us x{r['speedup_vs_ref']:.1f}"
        )
        if "us" in r
        else ""
    )
    err = r.get("error", f"err {r.get('max_err', float('nan')):.2e}")
    print(f"{status} {r['case']:<60} {err[:80]:<12} {timing}", flush=True)


def compile_only(args) -> list[dict]:
    """AOT-compile every kernel variant for sm_90 (catches Triton compile errors without a GPU)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vericache_kernels import _attn_triton as A
    from vericache_kernels import _pack_triton as P

    target = GPUTarget("cuda", 90, 32)
    jobs = []
    for bits in (2, 3, 4) if args.quick else range(1, 9):
        jobs.append(
            (
                f"pack b{bits}",
                P._pack_kernel,
                {"C": "*u8", "P": "*u8", "nbytes": "i32"},
                {"BITS": bits, "BLOCK": 1024},
                {},
            )
        )
        jobs.append(
            (
                f"unpack b{bits}",
                P._unpack_kernel,
                {"P": "*u8", "C": "*u8", "ncodes": "i32", "nbytes": "i32"},
                {"BITS": bits, "BLOCK": 1024},
                {},
            )
        )
    ptr = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
    cdt = {"float16": tl.float16, "bfloat16": tl.bfloat16, "float32": tl.float32}
    for mode in range(4):
        for dn in ("float16",) if args.quick else ("float16", "bfloat16", "float32"):
            for d in (64,) if args.quick else (64, 128):
                for kb, vb in ((4, 2),) if args.quick or mode < 2 else ((2, 2), (4, 4), (4, 2), (8, 8), (1, 1)):
                    sig = {}
                    for n in A._attn_split_kernel.arg_names:
                        if n in ("Q", "KT", "VT"):
                            sig[n] = ptr[dn]
                        elif n in ("OP", "LP", "KCB", "VCB"):
                            sig[n] = "*fp32"
                        elif n in ("KX", "VX"):
                            sig[n] = ptr[dn] if mode <= 1 else "*u8"
                        elif n in ("KS", "KZ", "VS", "VZ"):
                            sig[n] = "*fp16"
                        elif n == "IDX":
                            sig[n] = "*i64"
                        elif n == "qk_scale":
                            sig[n] = "fp32"
                        elif n in (
                            "MODE",
                            "K_BITS",
                            "V_BITS",
                            "K_GROUP",
                            "V_GROUP",
                            "D",
                            "BLOCK_M",
                            "BLOCK_N",
                            "PREC",
                            "CDT",
                        ):
                            continue
                        else:
                            sig[n] = "i32"
                    ce = dict(
                        MODE=mode,
                        K_BITS=kb if mode > 1 else 8,
                        V_BITS=vb if mode > 1 else 8,
                        K_GROUP=32,
                        V_GROUP=32,
                        D=d,
                        BLOCK_M=16,
                        BLOCK_N=32 if (dn == "float32" and d > 64) else 64,
                        PREC="ieee" if dn == "float32" else "tf32",
                        CDT=cdt[dn],
                    )
                    jobs.append(
                        (
                            f"attn mode{mode} {dn} D{d} k{kb}v{vb}",
                            A._attn_split_kernel,
                            sig,
                            ce,
                            {"num_warps": 4, "num_stages": 2},
                        )
                    )
    for dn in ("float16",) if args.quick else ("float16", "bfloat16", "float32"):
        for d in (64,) if args.quick else (64, 128):
            jobs.append(
                (
                    f"combine {dn} D{d}",
                    A._combine_kernel,
                    {"OP": "*fp32", "LP": "*fp32", "O": ptr[dn], "M": "i32", "S": "i32"},
                    {"D": d, "BLOCK_M": 16},
                    {},
                )
            )
    rows = []
    for name, fn, sig, ce, opts in jobs:
        row = {"case": f"compile {name}", "ok": False}
        t0 = time.time()
        try:
            sig = dict(sig, **{k: "constexpr" for k in ce})
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce), target=target, options=opts or None)
            row["shared_bytes"] = k.metadata.shared
            row["ok"] = k.metadata.shared <= 227 * 1024
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        row["wall_s"] = round(time.time() - t0, 2)
        rows.append(row)
        if not args.json:
            print(
                f"{'ok  ' if row['ok'] else 'FAIL'} {row['case']:<50} shared={row.get('shared_bytes')} "
                f"{row.get('error', '')[:200]}",
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="CPU: TRITON_INTERPRET=1 correctness only")
    ap.add_argument("--compile-only", action="store_true", help="CPU: AOT-compile kernels for sm_90")
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--json-out", help="also write the JSON document to this file")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="HBM bandwidth for the floor (H200: 4800)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels' Triton modules are imported
    import torch

    from vericache_kernels import triton_available

    if not triton_available():
        print("triton does not import: no Triton kernel to check", file=sys.stderr)
        return 2
    if args.compile_only:
        rows, mode = compile_only(args), "compile-only"
    elif args.interpret:
        rows, mode = run_checks(args), "interpret"
    elif not torch.cuda.is_available():
        print(
            "no CUDA device: nothing to time. On CPU use --interpret (correctness under "
            "TRITON_INTERPRET=1) or --compile-only (sm_90 AOT compile).",
            file=sys.stderr,
        )
        return 2
    else:
        rows, mode = run_checks(args), "cuda"
    n_fail = sum(not r["ok"] for r in rows)
    doc = {
        "mode": mode,
        "device": torch.cuda.get_device_name() if mode == "cuda" else "cpu",
        "torch": torch.__version__,
        "peak_gbs": args.peak_gbs,
        "n_cases": len(rows),
        "n_failed": n_fail,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"{len(rows) - n_fail}/{len(rows)} passed ({mode})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
