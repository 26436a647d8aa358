"""The helpers that the test folders share (tests/support/, imported as `support.<module>`: the
suite's `pythonpath` puts tests/ on sys.path). This file only names the checkout's folders, so
that importing one helper (e.g. `support.peer_stubs` from bench/) loads nothing else.

| module | what |
|---|---|
| `utils` | NaN-poisoning, the documented tolerances, `cpu_backends`, the peak-memory probe |
| `skips` | one reason string per cause of a skip, and the skip markers built on them |
| `prop` | the hypothesis budget and strategies of tests/properties |
| `step` | a whole PPO step (ops/test_ppo_step.py, cuda/test_cuda_losses.py) |
| `simt` | the SIMT emulator's routing (tests/simt, marker `simt`) |
| `gpu` | the `cuda` tests' marks, sizes and comparisons (tests/cuda) |
| `sampler_losses` | the fused losses under the sampler: inputs, settings, float64 references (ops, cuda) |
| `peer_stubs` | the peers imported without their cluster stack (tests, bench/, Ray workers) |
| `peers` | the peers' functions read from their source files |
| `integration` | patched-against-unpatched comparisons, verl's loss modules and configs |
| `dist_workers` | the gloo worker processes of ops/test_distributed.py (run by path), and `spawn`, which runs a workers' script from a test |
| `dist_preference_workers` | the gloo workers of ops/test_distributed_preference.py (run by path) |
| `dist_sampler_workers` | the gloo workers of ops/test_distributed_sampler.py (run by path) |
| `ray_tasks` | what integrations/test_ray.py runs in Ray workers |
| `trainer_workers` | the spawned ranks of trainer/test_e2e.py's data-parallel helpers test |
| `skip_summary` | plugin: the skips, one line per reason with its count |
| `file_order` | plugin: `--file-order=reverse` or `shuffle:SEED` |
| `state` | plugin: a test file leaves the process-wide state as it found it |
| `progress` | plugin: a quiet run names the running file after 30 s without a result |
| `triton_interpreter` | plugin: the Triton interpreter without patching its language again in each device-function call |
"""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
BENCH = os.path.join(ROOT, "bench")
