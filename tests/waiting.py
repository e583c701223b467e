"""Waiting in tests, on conditions only: `eventually` (until something holds) and `consistently`
(something keeps holding until something else happens). A fixed sleep before an assertion is
either too short on a loaded machine or too long everywhere else, and asserts once where the
condition can flap; these poll."""

from __future__ import annotations

import time


def eventually(check, timeout: float, what: str, interval: float = 0.3):
    """Poll `check()` until it returns something truthy and return that; AssertionError naming
    `what` (and the last value seen) after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(interval)


def consistently(check, until, timeout: float, what: str, interval: float = 0.3) -> None:
    """Assert `check()` is truthy at every poll until `until()` is (e.g. "five more runner
    passes"), which must happen within `timeout` seconds: the opposite of `eventually`."""
    end = time.monotonic() + timeout
    while not until():
        value = check()
        assert value, f"{what} stopped holding (last: {value!r})"
        assert time.monotonic() < end, f"timed out after {timeout:.0f} s waiting for the end of: {what}"
        time.sleep(interval)
    assert check(), f"{what} stopped holding"


def for_seconds(seconds: float):
    """An `until` for `consistently` when no event marks the end of the window (a process must
    not exit, a pod must stay unready): true once `seconds` have passed."""
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end
