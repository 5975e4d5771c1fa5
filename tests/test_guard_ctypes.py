"""Raw memory through ctypes is refused inside an answer: a plain-Python loop over numbers read with
`(ctypes.c_float * n).from_address(t.data_ptr())` escaped the trace and the read-out budget (cold review 12b of
chapters 00-02 passed 01-additive-score with it, 2/2 from the grader)."""

import ctypes

import pytest
import torch

from attncourse.classroom import checks
from attncourse.classroom.checks import CheckFailed


def _floats(t):
    t = t.detach().contiguous().to(torch.float32)
    return (ctypes.c_float * t.numel()).from_address(t.data_ptr())[:]


def through_ctypes(s, h, w_q, w_k, v):
    values = _floats(h)  # the learner's own code reads the tensor's memory
    return torch.frombuffer(bytearray(ctypes.c_float(sum(values))), dtype=torch.float32).expand(h.shape[0], h.shape[1])


def string_at(s, h, w_q, w_k, v):
    raw = ctypes.string_at(h.data_ptr(), 4)
    return torch.zeros(h.shape[0], h.shape[1]) + len(raw)


@pytest.mark.parametrize("answer", [through_ctypes, string_at])
def test_reading_tensor_memory_with_ctypes_is_refused(answer):
    with pytest.raises(CheckFailed, match="ctypes"):
        checks.check("01-additive-score", answer)


def test_ctypes_outside_an_answer_is_untouched():
    x = torch.arange(4, dtype=torch.float32)
    assert _floats(x) == [0.0, 1.0, 2.0, 3.0]
