"""The GPT and the CNN of bench/remat_bench.py as a plain training script (it knows nothing of
pymem), for ``pymem profile`` on a real device and on the meta device (bench/sim_calibration.py):

    python bench/train_script.py --model gpt|cnn [--steps 20] [--batch B] [--seq T] [--device D]

Adam steps on a fixed random batch, the loss printed after each. Every tensor is made on the
default device: without ``--device`` that is whatever the caller set (``pymem profile --device
meta`` sets meta); with it, ``torch.set_default_device(D)``. On CUDA: no TF32, deterministic
algorithms (warnings only), math attention, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set before CUDA starts).

Default sizes are for a GPU (an H100: roughly 15-30 ms a step unmanaged in fp32, so launches and
Python do not dominate); on a CPU use small ones, e.g. ``--batch 2 --seq 64`` (gpt) or ``--batch 2
--size 32`` (cnn):

    gpt: TinyGPT of pymem.demo_models (dropout 0.1), vocab 512, d 512, 8 heads, 4 layers, seq 512,
         batch 16 (TinyGPT with remat_bench's defaults is d 128, seq 256: far under a millisecond
         of compute on an H100)
    cnn: SmallResNet of remat_bench.py (BatchNorm), width 64, 2 blocks a stage, 64x64 images,
         batch 64
"""
import argparse
import os
import sys
import types

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: before CUDA starts

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from remat_bench import make_cnn, make_transformer  # noqa: E402  (the builders: model, Adam, data)

GPU_DEFAULTS = {"gpt": {"batch": 16, "seq": 512}, "cnn": {"batch": 64}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("gpt", "cnn"), required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=None, help="default: 16 (gpt), 64 (cnn)")
    ap.add_argument("--seq", type=int, default=512, help="gpt: tokens a sequence")
    ap.add_argument("--d", type=int, default=512, help="gpt: model width")
    ap.add_argument("--heads", type=int, default=8, help="gpt")
    ap.add_argument("--layers", type=int, default=4, help="gpt")
    ap.add_argument("--vocab", type=int, default=512, help="gpt")
    ap.add_argument("--width", type=int, default=64, help="cnn: channels of the first stage")
    ap.add_argument("--blocks", type=int, default=2, help="cnn: basic blocks a stage")
    ap.add_argument("--size", type=int, default=64, help="cnn: image side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--device", default=None,
                    help="torch.set_default_device(D); default: leave the default device as it is")
    a = ap.parse_args()
    if a.batch is None:
        a.batch = GPU_DEFAULTS[a.model]["batch"]
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device is not None:
        torch.set_default_device(a.device)
    if torch.get_default_device().type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        # the math attention kernel: fp32 would run the memory-efficient one, whose backward adds
        # with atomics, so that two unmanaged runs differ and no managed run can match them bitwise
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)

    # remat_bench's builders read their sizes from its argparse namespace
    cfg = types.SimpleNamespace(seed=a.seed, gpt_vocab=a.vocab, gpt_d=a.d, gpt_heads=a.heads,
                                gpt_layers=a.layers, gpt_seq=a.seq, gpt_batch=a.batch, cnn_width=a.width,
                                cnn_blocks=a.blocks, cnn_batch=a.batch, cnn_size=a.size)
    step = make_transformer(cfg) if a.model == "gpt" else make_cnn(cfg)
    for i in range(a.steps):
        print(f"step {i} loss {step():.6f}", flush=True)


if __name__ == "__main__":
    main()
