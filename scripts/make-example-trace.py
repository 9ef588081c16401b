"""Make the shipped example trace (scenarios/traces/example.safetensors) with the recorder.

The selections come from capture/msa_indexer.py's small MSA-style model on random weights, run on smooth
random hidden states: a synthetic capture that shows the whole path (record, load, statistics, sweep), not
any real model's selections. Deterministic: the same file on every run.

    python scripts/make-example-trace.py [OUT]
"""
import sys
from pathlib import Path

import torch

from msa_bench.capture import Recorder
from msa_bench.capture.msa_indexer import TinyMSAModel, smooth_hidden
from msa_bench.roofline.shape import AttnShape

OUT = Path(__file__).resolve().parents[1] / "scenarios" / "traces" / "example.safetensors"
CONTEXTS = (16384, 32768)        # two requests, each a 512-token prefill chunk at the end of its context
CHUNK, DECODE_STEPS, EVERY = 512, 8, 4
WIDTH, RHO, SEED = 128, 0.995, 0


def main(out: Path) -> None:
    shape = AttnShape()          # MiniMax-M3: Hq 64, Hkv 4, D 128, blocks of 128 tokens, top-16
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    model = TinyMSAModel(shape, layers=3, width=WIDTH, seed=SEED)
    hidden = [smooth_hidden(c + DECODE_STEPS, WIDTH, RHO, gen) for c in CONTEXTS]
    provenance = {
        "model": "capture/msa_indexer.py TinyMSAModel, 3 layers, random weights (seed 0)",
        "engine": "msa_bench.capture.Recorder on CPU (scripts/make-example-trace.py)",
        "prompts": f"smooth random hidden states (rho {RHO}), requests of {list(CONTEXTS)} tokens",
        "synthetic": "a synthetic capture from random weights: not a real model's selections",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out, shape, every=EVERY, provenance=provenance)
    rec.step()                   # step 0: the prefill chunks of both requests in one call
    model([h[:c] for h, c in zip(hidden, CONTEXTS)], [torch.arange(c - CHUNK, c) for c in CONTEXTS], rec)
    for s in range(1, DECODE_STEPS + 1):       # then decode: one token a request a step
        rec.step()
        model([h[:c + s] for h, c in zip(hidden, CONTEXTS)], [torch.tensor([c + s - 1]) for c in CONTEXTS], rec)
    kept = rec.calls
    path = rec.close()
    print(f"wrote {path}: {kept} calls, {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
