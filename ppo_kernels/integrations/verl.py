"""`VERL_USE_EXTERNAL_MODULES=ppo_kernels.integrations.verl`: verl imports this module on its own
import (in the driver and in every Ray worker it starts), which patches verl's per-token math with
ppo_kernels ops. strict=False (an unsupported call runs verl's own code, counted in
`ppo_kernels.integrations.report("verl")`) unless PPO_KERNELS_PATCH_STRICT=1; the actor's log-probs
under the rollout's truncation with PPO_KERNELS_VERL_SAMPLING="top_k=50,top_p=0.9" (the rollout
config's values)."""

import os

from . import apply, env_options

apply("verl", strict=os.environ.get("PPO_KERNELS_PATCH_STRICT", "0") == "1", **env_options("verl"))
