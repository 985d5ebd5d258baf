"""A change's predicted downtime (pool.change_cost), which the live pool and its simulator share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from parashift.pool.change_cost import RESTART_S, WARM_CHANGE_S, change_downtime_s, state_bytes


@given(state=st.floats(0.0, 1e13), before=st.integers(0, 512), after=st.integers(1, 512),
       bandwidth=st.floats(1e6, 1e11))
def test_warm_costs_its_fixed_part_and_each_new_device_s_share_and_a_restart_more(state: float, before: int,
                                                                                  after: int, bandwidth: float) -> None:
    warm = change_downtime_s(state, before, after, warm=True, read_bytes_per_s=bandwidth)
    cold = change_downtime_s(state, before, after, warm=False, read_bytes_per_s=bandwidth)
    assert warm == pytest.approx(WARM_CHANGE_S + state / (after * bandwidth))
    assert cold >= warm + (RESTART_S - WARM_CHANGE_S) * (1 - 1e-12), "a restart also saves and starts again"
    more = change_downtime_s(state * 2 + 1e9, before, after, warm=True, read_bytes_per_s=bandwidth)
    assert more > warm, "more state costs more"


def test_a_llama_3_8b_state_is_weights_and_adam_moments_in_fp32() -> None:
    assert state_bytes(8_030_261_248) == 12 * 8_030_261_248  # 96.4 GB: 81.7 s to one device at 1.18 GB/s
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        change_downtime_s(1.0, 1, 1, warm=True, read_bytes_per_s=0.0)
