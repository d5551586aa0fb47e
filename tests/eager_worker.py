"""One worker process of tests/test_diloco_eager.py: DiLoCo with overlap="eager" for some rounds
over real TCP, then one JSON line with its global parameters' digest and the last outer step's
contributors. `--die R`: this process kills itself (SIGKILL) in the middle of round R's local
steps, as a crashed machine would stop. `--compression sparse`: sparse pseudo-gradients (then
the model after flush() is the global parameters less the accumulator)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

import torch

import fttree

H = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--peers", required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--die", type=int, default=None)
    p.add_argument("--compression", choices=["int8", "sparse"], default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    ar = fttree.FTTreeAllreduce(args.rank, args.peers.split(","), timeout_s=0.2, step_timeout_s=20.0).start()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))
        compression = fttree.Sparse(density=1 / 8, block=32) if args.compression == "sparse" else args.compression
        opt = fttree.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), allreduce=ar, sync_every=H,
                            overlap="eager", compression=compression)
        for r in range(args.rounds):
            for i in range(H):
                if args.die == r and i == H // 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                g = torch.Generator().manual_seed(args.rank * 100_003 + r * H + i)
                x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        opt.flush()
        h = hashlib.blake2b(digest_size=16)
        for _, t in opt.global_parameters:
            h.update(t.numpy().tobytes())
        assert opt.last_step is not None
        kept = opt._sparse.codec.residuals() if opt._sparse is not None else [torch.zeros(0)] * len(opt._global)
        print(json.dumps({"rank": args.rank, "global": h.hexdigest(), "outer_steps": opt.outer_steps,
                          "contributors": list(opt.last_step.contributors),
                          "model_is_global": all(torch.equal(p, g if k.numel() == 0 else g - k) for p, (_, g), k in
                                                 zip(model.parameters(), opt.global_parameters, kept, strict=True)),
                          "unsent": sum(float(k.abs().sum()) for k in kept)}),
              flush=True)
    finally:
        ar.close()


if __name__ == "__main__":
    main()
