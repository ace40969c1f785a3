import os, sys, time, json, subprocess, statistics
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
if len(sys.argv) > 1 and sys.argv[1] == "child":
    budget, offload, prof = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    import torch, pymem
    from pymem.testing import deterministic_cuda
    from pymem.demo_models import gpt_trainer
    if budget != "none":
        pymem.enable(int(budget), device="cuda", offload=offload)
    deterministic_cuda()
    step = gpt_trainer(batch=64, seq=256, device="cuda")
    times = []
    for i in range(8):
        if prof and i == 5:
            import cProfile, pstats; pr = cProfile.Profile(); pr.enable()
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    if prof:
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    st = pymem.memory_stats() if budget != "none" else {}
    print("RESULT", json.dumps({"times": times, "peak": torch.cuda.max_memory_allocated() if budget == "none" else 0,
        **{k: st.get(k) for k in ("allocated_bytes.peak", "num_evictions", "num_rematerializations", "remat_seconds", "offloaded_bytes", "swap_seconds", "num_late_uses", "num_ops", "num_compactions", "num_swap_ins", "num_prefetches")}}))
    sys.exit(0)
def child(budget, offload, prof=False):
    r = subprocess.run([sys.executable, __file__, "child", str(budget), offload, "1" if prof else "0"], capture_output=True, text=True)
    if prof: print(r.stdout[-6000:])
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
    if not line: print(r.stderr[-3000:]); return None
    return json.loads(line[0][7:])
ref = child("none", "x")
peak = ref["peak"]; base = statistics.median(ref["times"][2:])
print(f"unmanaged peak {peak/2**20:.0f} MiB step {base*1e3:.1f} ms")
for ratio, off, prof in [(20.0, "never", False), (1.0, "delta", False), (0.5, "never", False), (0.5, "delta", False), (0.5, "always", False), (0.5, "delta", True)]:
    r = child(int(peak * ratio) // 512 * 512, off, prof)
    if r is None: print(ratio, off, "FAILED"); continue
    m = statistics.median(r["times"][2:])
    print(f"ratio {ratio} {off}: step {m*1e3:.1f} ms = {m/base:.2f}x; per-step {[round(t*1e3) for t in r['times']]}; " + json.dumps({k: v for k, v in r.items() if k not in ('times',)}))
