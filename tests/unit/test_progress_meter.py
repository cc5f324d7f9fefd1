"""The progress contract every long stage reports through: done/total, unit, rate, ETA, throttled."""

from __future__ import annotations

from eagle3_dagster.stages import ProgressMeter, format_duration


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def meter(lines: list[str], clock: Clock, total: int | None = 1000, **kw) -> ProgressMeter:
    return ProgressMeter(lines.append, "hidden_states[shard-00000]", "tokens", total, clock=clock, every_s=5.0, **kw)


def test_a_line_names_done_total_unit_rate_and_eta():
    lines, clock = [], Clock()
    m = meter(lines, clock)
    clock.t += 2.0
    m(250, 1000)  # extract_hf's progress(done, total)
    assert lines == ["hidden_states[shard-00000]: 250/1,000 tokens (25.0%), 125 tokens/s, ETA 0:00:06"]


def test_lines_are_throttled_but_the_first_and_the_last_always_appear():
    lines, clock = [], Clock()
    m = meter(lines, clock)
    for done in range(100, 1001, 100):
        clock.t += 1.0
        m(done)
    # 1 s apart: the first, one 5 s later, and the last
    assert [line.split(":")[1].split()[0] for line in lines] == ["100/1,000", "600/1,000", "1,000/1,000"]
    assert lines[-1].endswith("ETA 0:00:00")


def test_work_done_before_a_resume_is_not_counted_in_the_rate():
    lines, clock = [], Clock()
    m = meter(lines, clock, total=100, initial=90)
    clock.t += 10.0
    m.update(95)
    assert "0.5 tokens/s" in lines[0] and "ETA 0:00:10" in lines[0]


def test_an_unknown_total_gives_a_count_and_a_rate_without_eta():
    lines, clock = [], Clock()
    m = meter(lines, clock, total=None)
    clock.t += 4.0
    m.update(2000)
    assert lines == ["hidden_states[shard-00000]: 2,000 tokens, 500 tokens/s"]


def test_durations_read_as_hours_minutes_seconds():
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(None) == "unknown"
