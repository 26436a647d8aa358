"""The worker of tests/trainer/test_e2e.py's data-parallel helpers test, in a module that a
spawned process imports by name (a test file is imported by path under a name no child finds)."""

import os
import sys

import torch


def dp_worker(rank, init_file, out_dir):
    import torch.distributed as tdist

    from ppo_kernels.trainer import dist

    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    g = tdist.group.WORLD
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))  # row r: rank r's
    grads = {}
    for mode in dist.MODES:
        torch.manual_seed(0)
        model = dist.wrap(torch.nn.Linear(3, 2), mode, g)
        model(x[rank]).square().mean().backward()
        grads[mode] = [dist.local(p.grad) for p in model.parameters()]
        sd = dist.state_dict(model, everywhere=True)
    out = {
        "grads": grads,
        "state": sd,
        "means": dist.global_means({"a": (float(rank), 1), "w": (3.0 * rank, 1 + 2 * rank)}, g),
        "share": dist.share(list(range(6)), g),
        "span": [dist.span(0, n, g) for n in (2, 5)],
        "chunks": dist.chunks(201, 100, g),
        "any": (dist.any_true(rank == 1, g), dist.any_true(False, g)),
    }
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    del model  # the wrapped model holds the group: gone before it (see dist.close)
    dist.close(g)
    # no interpreter finalization (see ppo_kernels/__main__.py): a gloo thread destroyed there
    # can abort a worker whose checks all passed; a failed check raised above
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
