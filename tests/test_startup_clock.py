import re

import pytest

from rimuru.engine.startup_clock import StartupClock


def test_phases_in_order_with_their_parts_and_a_total_that_is_their_sum() -> None:
    clock = StartupClock()
    clock.mark("model built", "model")
    clock.add("the host store", 0.25)
    clock.mark("memory plan", "memory_plan")
    text = clock.describe()
    assert [p[0] for p in clock.phases] == ["model built", "memory plan"]
    assert clock.phases[0][2] == [] and clock.phases[1][2] == [("the host store", 0.25)]
    assert re.fullmatch(r"model built \d+\.\d s, memory plan \d+\.\d s \(of which the host store 0\.2 s\); "
                        r"total \d+\.\d s", text), text
    assert abs(clock.total_s - sum(seconds for _, seconds, _ in clock.phases)) < 1e-9
    assert clock.seconds == {"model": clock.phases[0][1], "memory_plan": clock.phases[1][1]}


def test_a_phase_key_outside_the_known_ones_is_refused_by_name() -> None:
    clock = StartupClock()
    with pytest.raises(ValueError, match="'warmup' is not one of"):
        clock.mark("warm-up", "warmup")
    assert clock.phases == [] and clock.seconds == {}
