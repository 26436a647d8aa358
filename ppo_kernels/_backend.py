"""The base layer in one import: a thin facade over the modules that each do one job. Callers
write `_backend.X`; nothing is defined here.

  _extension  loading the compiled extension (never under another torch), HAS_EXTENSION,
              HAS_TRITON, which compiled kernels exist, the `cpp` backend's op namespace
  _registry   the ops: backend keys, public names, delegations (BACKENDS, OPS, PUBLIC)
  _dispatch   backend choice (use_backend, PPO_KERNELS_BACKEND, the defaults), the per-backend
              Kernel objects, the C++ routing table
  _settings   strict checks and batch-invariant mode (and the eager kernels' helpers for it)
  _outputs    new_output and the NaN-poisoning test hook
  _library    torch.library: impl / fake / fallback / op, constant_result

The values re-exported here are the same objects; state is changed through the functions
(use_backend, strict_checks, batch_invariant, set_poison, ...), and HAS_EXTENSION / HAS_TRITON
are fixed at import (a run without the extension is a process with PPO_KERNELS_NO_EXTENSION=1).
"""

from __future__ import annotations

from ._dispatch import (  # noqa: F401
    KERNELS,
    Kernel,
    any_requested,
    available,
    backend_for,
    default_backend,
    getenv,
    refresh_backends,
    resolve,
    routes_in_cpp,
    triton_interpreting,
    use_backend,
)
from ._extension import (  # noqa: F401
    EXTENSION_ERROR,
    HAS_EXTENSION,
    HAS_TRITON,
    cpp_ops,
    has_compiled_kernel,
    use_cpp_namespace,
)
from ._library import (  # noqa: F401
    constant_result,
    fake,
    fallback,
    impl,
    op,
    python_impl,
    registered,
)
from ._outputs import new_output, set_poison  # noqa: F401
from ._registry import (  # noqa: F401
    BACKENDS,
    OPS,
    PUBLIC,
    OpInfo,
    delegation,
    delegations,
    has_backend,
    note_delegation,
    op_key,
    register_op,
)
from ._settings import (  # noqa: F401
    EAGER_ROW_BLOCK,
    batch_invariant,
    invariant,
    invariant_rows,
    invariant_threads,
    strict,
    strict_checks,
)
