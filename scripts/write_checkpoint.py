"""Write a preset's seeded random weights as a transformers checkpoint directory (GPU check helper):
python3 scripts/write_checkpoint.py llama-1b /tmp/ckpt_llama1b [cuda]"""

import sys
import time

import torch

from tscompile.models import build_model
from tscompile.models.hf_save import save_hf_checkpoint

preset, out = sys.argv[1], sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else ("cuda" if torch.cuda.is_available() else "cpu")
start = time.perf_counter()
model = build_model(preset, dtype=torch.bfloat16, device=device, seed=0)
save_hf_checkpoint(model, out)
print(f"wrote {preset} to {out} in {time.perf_counter() - start:.1f} s")
