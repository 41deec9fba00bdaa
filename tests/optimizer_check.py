"""Run under torchrun: build the trainer with ``--load CKPT`` and compare the optimizer state each rank
now holds with the checkpoint's files, read independently (safetensors + JSON).

    python -m torch.distributed.run --nproc_per_node N tests/optimizer_check.py \
        CONFIG --root ROOT MANIFEST CKPT PLUGIN DTYPE

Under ZeRO each rank must hold its 1/N share of every parameter's moments, cut as ZeRO cuts
(flattened, zero-padded to a multiple of N, chunk r), whatever world size wrote them. Prints one
JSON line from rank 0: the largest difference over all ranks and parameters, and the step counts.
"""

import json
import sys
from pathlib import Path

from grad_check import debug_stage_config
from safetensors.torch import load_file

from reelcache.train.trainer import Trainer


def main(config, root, manifest, ckpt, plugin, dtype):
    cfg = debug_stage_config(config, manifest, plugin, dtype, f'run.name="optcheck-{Path(ckpt).parent.name}"')
    tr = Trainer(cfg, root, load=ckpt)
    par = tr.par
    saved = load_file(str(Path(ckpt) / "optimizer/state.safetensors"))
    steps_saved = {
        n: sc["step"] for n, sc in json.loads((Path(ckpt) / "optimizer/optimizer.json").read_text())["scalars"].items()
    }
    # Optimizer parameter -> name: under ZeRO the optimizer holds master shards of the working parameters.
    by_id = {id(p): n for n, p in tr.module.named_parameters()}
    working = tr.optimizer.get_master_to_working_map() if par.zero else {}
    inner = tr.optimizer.optim if par.zero else tr.optimizer
    err, steps, checked = 0.0, set(), 0
    for p in (p for g in tr.optimizer.param_groups for p in g["params"]):
        name = by_id[id(working.get(id(p), p))]
        state = inner.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            full = saved[f"{name}::{key}"].reshape(-1)
            want = par.chunk(full) if par.zero else full
            err = max(err, float((state[key].reshape(-1).float() - want.float()).abs().max()))
            checked += 1
        steps.add((int(float(state["step"])), steps_saved[name]))
    err = float(par.max([err])[0])
    if par.rank == 0:
        print(
            json.dumps({"world": par.world, "max_abs_diff": err, "steps": sorted(steps), "tensors": checked}),
            flush=True,
        )
    par.close()


if __name__ == "__main__":  # as support.torchrun starts it: CONFIG --root ROOT ...
    config, _, root, *rest = sys.argv[1:]
    main(config, root, *rest)
