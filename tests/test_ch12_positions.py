"""Chapter 12's position control (attncourse.sink_positions): its measurement is section 2's."""

import pytest
import torch

from attncourse import sink_positions as sp


def test_measure_reproduces_section_2_on_the_learned_position_gpt():
    stored = torch.load(sp.RESULTS / "sink_gpt.pt")
    model = sp.new_gpt(0, "learned")
    model.load_state_dict(stored["runs"][0]["state"])
    r = sp.measure(model.eval())
    assert abs(r["repeat"] - 0.35) < 0.01 and r["count"] == [0, 12] and round(r["ratio"][1]) == 194
    assert [round(x, 2) for x in r["sf"][0]] == [0.78, 0.84, 0.56, 0.49]  # lesson 12, section 2's printout


def test_run_one_rejects_unknown_settings():
    with pytest.raises(ValueError, match="position"):
        sp.run_one("alibi", 0)
