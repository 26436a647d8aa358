// The torch headers most C++ sources of ppo_kernels._C include, in one header that setup.py
// precompiles once per build and force-includes first in each of them (-include): parsing these
// headers is most of a source's compile time. No source depends on it: each still includes what
// it uses, and a build without it (or with a precompiled header gcc refuses) is the same build.
#include <Python.h>  // first, as Python asks (it sets feature macros the C headers read)

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/library.h>
