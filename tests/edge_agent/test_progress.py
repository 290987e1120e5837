"""TerminalProgress: drawn only on a terminal, throttled, lines always ended."""

from __future__ import annotations

import io

from edge_agent.progress import TerminalProgress, render


class FakeTerminal(io.StringIO):
    """A StringIO that claims to be a TTY."""

    def isatty(self) -> bool:
        return True


def test_render_fills_the_bar_in_proportion() -> None:
    assert render("dev", 3, "train", step=0, total=40, loss=2.5) == (
        "[dev] round 3 train    [........................]  0/40  loss 2.5000"
    )
    half = render("dev", 3, "train", step=20, total=40, loss=1.0)
    assert "[############............]" in half and "20/40" in half
    assert "[########################]" in render("dev", 3, "final", step=40, total=40, loss=0.1)
    assert "[########################]" in render(
        "dev", 1, "train", step=5, total=0, loss=0.0
    )  # no steps


def test_nothing_is_written_when_the_stream_is_not_a_terminal() -> None:
    out = io.StringIO()
    bar = TerminalProgress("dev", out, interval_s=0.0)
    bar.update(1, "train", 1, 2, 0.5)
    bar.update(1, "train", 2, 2, 0.5)
    bar.close()
    assert out.getvalue() == ""


def test_redraws_in_place_and_ends_the_line_on_the_last_step() -> None:
    out = FakeTerminal()
    bar = TerminalProgress("dev", out, interval_s=0.0)
    for step in (1, 2, 3):
        bar.update(2, "train", step, 3, 0.25)
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("3/3  loss 0.2500\n")
    bar.close()  # the line is already ended: nothing more
    assert out.getvalue() == text


def test_throttled_between_steps_but_the_last_step_always_draws() -> None:
    out = FakeTerminal()
    bar = TerminalProgress("dev", out, interval_s=3600.0)
    for step in range(1, 101):
        bar.update(1, "train", step, 100, 0.1)
    assert out.getvalue().count("\r") == 2  # the first step and the last
    assert out.getvalue().endswith("100/100  loss 0.1000\n")


def test_close_ends_a_line_left_open_by_a_failed_task() -> None:
    out = FakeTerminal()
    bar = TerminalProgress("dev", out, interval_s=0.0)
    bar.update(1, "train", 1, 10, 0.1)
    bar.close()
    assert out.getvalue().endswith("\n")
    bar.close()
    assert out.getvalue().count("\n") == 1
