"""The demo's model (TinyGPT, 4 layers, d 128) as a plain training script, for ``pymem profile``:

    pymem profile -- bench/demo_train.py [--steps 20] [--batch 8] [--seq 128]

It knows nothing of pymem: Adam steps on a fixed random batch, the loss printed after each.
"""
import argparse
import os

import torch

from pymem.demo_models import gpt_trainer

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--seq", type=int, default=128)
args = ap.parse_args()
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
step = gpt_trainer(batch=args.batch, seq=args.seq)
for i in range(args.steps):
    print(f"step {i} loss {step():.6f}")
