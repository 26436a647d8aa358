"""The CPU suite's edge-case tests (special values, strided and masked rows, custom ignore_index,
inplace backward, empty inputs, scaled logits that overflow float32, GAE's masks / dones / carries / packed rows), rerun with the
emulated CUDA kernels as the `cpp` backend (see tests/support/simt.py). Tests of CPU-only behaviour
(IndexError for out-of-range labels, peak memory, opcheck, compile) are not rerun; the GPU's
NaN contract for labels is tests/simt/test_kernels.py::test_token_logprobs_bad_labels."""

import pytest
import torch
from support.simt import MARKS, SEEDS, emulated, launches
from support.utils import load_test_file

EC = load_test_file("ops/test_edge_cases.py")
FK = load_test_file("ops/test_full_kl.py")
GA = load_test_file("ops/test_gae.py")
TL = load_test_file("ops/test_token_logprobs.py")

pytestmark = MARKS

CASES = [
    (TL.test_documented_edge_rows, {}),
    (TL.test_temperature_and_logprob_only_gradient, {"T": 0.3}),
    (TL.test_entropy_only_gradient_and_custom_ignore_index, {}),
    (TL.test_strided_logits_are_read_without_copy, {"dtype": torch.bfloat16}),
    (TL.test_inplace_backward_writes_gradient_into_logits, {}),
    (TL.test_empty_inputs, {}),
    (EC.test_token_logprobs_backward_non_collapsing_strides, {"inplace": False}),
    (EC.test_token_logprobs_backward_non_collapsing_strides, {"inplace": True}),
    (EC.test_token_logprobs_scaled_logit_overflow_is_finite, {"with_entropy": True}),
    (EC.test_token_logprobs_scaled_logit_overflow_is_finite, {"with_entropy": False}),
    (FK.test_identical_and_shifted_distributions_are_exactly_zero, {}),
    (FK.test_small_kl_relative_accuracy, {}),
    (FK.test_mask_and_strided_rows, {}),
    (FK.test_edge_cases, {}),
    (GA.test_masks_every_dtype, {"dtype": torch.float16, "T": 37}),
    (GA.test_dones_bootstrap_carry, {}),
    (GA.test_gamma_lam_extremes, {"gl": (0.0, 0.7)}),
    (GA.test_gamma_lam_extremes, {"gl": (1.0, 1.0)}),
    (GA.test_per_token_gamma_lam, {}),
    (GA.test_packed_rows, {"dtype": torch.float32}),
    (GA.test_chunked_with_carry_equals_whole, {}),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "test,kwargs", CASES, ids=[f"{t.__module__.rsplit('.', 1)[-1]}.{t.__name__}" for t, _ in CASES]
)
def test_cpu_suite_case_on_the_emulated_cuda_kernels(seed, test, kwargs):
    torch.manual_seed(0)
    with emulated(seed, sm_count=1):
        test("cpp", **kwargs)
    assert launches() or test is TL.test_empty_inputs  # the emulated kernels did run
