"""Is the GPU power-capped while the layer runs? Per phase (the 235B T = 8192 and 16384 and 30B T = 8192 FC1, FC2
and forward, back to back and with 20 ms of idle between calls; cuBLAS's bmm on FC1's FLOPs with even routing):
median ms, TFLOP/s, and the SM clock, board power and clock-event reasons nvidia-smi reports every 50 ms,
averaged over the phase. Usage (on the GPU machine): OUT=<dir> python scripts/clock_state.py; writes
$OUT/clock_state.json. Fourteenth session: back to back, every sample carried reason 0x4 (software power cap)."""
import subprocess, time, statistics, os, json
import torch
from layer_inputs import layer_inputs
from primemoe import ops
from primemoe.bench import SHAPES, gpu_uuid
lib = torch.ops.primemoe
fields = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
smi_path = "/tmp/clock_state_smi.csv"
# This process's GPU only: on a host with several, nvidia-smi prints a line per GPU, and the idle ones would be
# averaged in.
uuid = gpu_uuid(torch.cuda.current_device())
smi = subprocess.Popen(["nvidia-smi", "-i", uuid, f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                        "-lms", "50"], stdout=open(smi_path, "w"))
results = []
def phase(name, fn, secs=2.0, gap=0.0, flops=None):
    torch.cuda.synchronize(); time.sleep(0.8)
    t0 = time.time(); ts = []; end = t0 + secs
    while time.time() < end:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        if gap: e.synchronize(); time.sleep(gap)
        ts.append((s, e))
    torch.cuda.synchronize(); t1 = time.time()
    ms = [s.elapsed_time(e) for s, e in ts]
    results.append(dict(name=name, t0=t0 + 0.3, t1=t1, n=len(ms), median=statistics.median(ms),
                        tflops=(flops / statistics.median(ms) / 1e9) if flops else None))
    print(name, len(ms), round(statistics.median(ms), 3), flush=True)
for shape, T in (("qwen3-235b-a22b", 8192), ("qwen3-235b-a22b", 16384), ("qwen3-30b-a3b", 8192)):
    H, I, E, K = SHAPES[shape]
    x, idx, w, w1, w2, _ = layer_inputs(shape, T)
    cnt, off, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, 64)
    xs = lib.gather_rows(x, r2s, K, None, s2r)
    a, h = lib.fc1_swiglu(xs, w1, off, True)
    rw = ops.row_weights(w, r2s)
    tag = f"{shape} T={T}"
    fl_fc1 = 2 * T * K * H * 2 * I
    for gap in (0.0, 0.02):
        g = " gaps" if gap else " b2b"
        phase(tag + " fc1" + g, lambda: lib.fc1_swiglu(xs, w1, off, True), gap=gap, flops=fl_fc1)
        phase(tag + " fc2" + g, lambda: lib.expert_gemm(a, w2, off, False, rw), gap=gap, flops=fl_fc1 / 2)
        phase(tag + " forward" + g, lambda: ops.moe_forward_composed(x, idx, w, w1, w2, True, True, 64), gap=gap,
              flops=6 * T * K * H * I)
    if shape == "qwen3-235b-a22b" and T == 8192:
        # cuBLAS on the same work with perfectly even routing (512 rows per expert, no padding).
        xb = torch.randn(E, T * K // E, H, device="cuda", dtype=torch.bfloat16)
        w1t = w1.transpose(1, 2)
        phase(tag + " cublas bmm fc1-equivalent b2b", lambda: torch.bmm(xb, w1t), flops=fl_fc1)
        phase(tag + " cublas bmm fc1-equivalent gaps", lambda: torch.bmm(xb, w1t), gap=0.02, flops=fl_fc1)
        del xb
time.sleep(0.3); smi.terminate(); time.sleep(0.2)
samples = []
for line in open(smi_path):
    p = [f.strip() for f in line.split(",")]
    try:
        ts = time.mktime(time.strptime(p[0][:19], "%Y/%m/%d %H:%M:%S")) + float("0" + p[0][19:])
        samples.append((ts, float(p[1]), float(p[2]), p[3]))
    except Exception:
        pass
for r in results:
    s = [x for x in samples if r["t0"] <= x[0] <= r["t1"]]
    r["sm_mhz"] = round(statistics.mean(x[1] for x in s), 0) if s else None
    r["watts"] = round(statistics.mean(x[2] for x in s), 0) if s else None
    r["capped"] = sum(x[3] != "0x0000000000000000" for x in s), len(s)
    print(f"{r['name']:55} n={r['n']:5} {r['median']:7.3f} ms {r['tflops'] or 0:6.1f} TF/s  {r['sm_mhz']} MHz "
          f"{r['watts']} W capped {r['capped']}")
json.dump(results, open(os.environ.get("OUT", ".") + "/clock_state.json", "w"), indent=1)
