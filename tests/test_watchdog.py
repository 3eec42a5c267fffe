"""gpufleet.watchdog (issue 18): a deadline around the user's code that interrupts it wherever it is,
with heartbeats while it is slow; and the reward values TRL accepts (numpy scalars, 0-d tensors)."""

from __future__ import annotations

import math
import signal
import threading
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from gpufleet.errors import UserError
from gpufleet.rl.rewards import _call_checked, _real
from gpufleet.watchdog import Overdue, deadline, where_stuck


def test_a_sleeping_call_is_interrupted_and_where_it_was_is_known():
    before = signal.getsignal(signal.SIGUSR2)
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(Overdue) as e:
        with deadline("the sleeper", 0.5, first=0.1, every=0.1, say=lines.append):
            time.sleep(60)
    assert time.monotonic() - start < 30
    assert lines and all(x.startswith("gpufleet: waiting for the sleeper for") for x in lines)
    assert "(limit 0.5 s)" in lines[0]
    assert where_stuck(e.value).startswith(__file__ + ":")
    assert signal.getsignal(signal.SIGUSR2) is before  # the previous handler is back


def test_except_exception_in_user_code_does_not_swallow_it():
    def stubborn():
        while True:
            try:
                time.sleep(60)
            except Exception:  # a user's catch-all: Overdue is a BaseException and passes through
                pass

    with pytest.raises(Overdue):
        with deadline("stubborn", 0.3, say=lambda _: None):
            stubborn()


def test_a_fast_call_is_left_alone():
    lines: list[str] = []
    with deadline("quick", 5.0, first=5.0, say=lines.append):
        x = sum(range(1000))
    assert x == 499500 and lines == []
    time.sleep(0.2)  # no late interrupt arrives after the block


def test_off_the_main_thread_there_are_heartbeats_but_no_interrupt():
    lines: list[str] = []
    done = []

    def work():
        with deadline("in a thread", 0.1, first=0.1, every=0.1, say=lines.append):
            time.sleep(0.5)
        done.append(True)

    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    assert done == [True] and lines


# ------------------------------------------------------------------------------------ reward values

REAL = [
    (0.5, 0.5),
    (3, 3.0),
    (np.float32(0.5), 0.5),
    (np.float64(-1.25), -1.25),
    (np.int64(2), 2.0),
    (torch.tensor(0.5), 0.5),
    (torch.tensor(2, dtype=torch.int32), 2.0),
    (np.array(1.5), 1.5),
    (Fraction(1, 4), 0.25),
    (True, 1.0),  # TRL's torch.tensor(..., dtype=float32) of a list of bools
    (np.bool_(False), 0.0),
    (torch.tensor(True), 1.0),
]
NOT_REAL = [
    "1.0",
    float("inf"),
    np.float32("nan"),
    torch.tensor([0.5]),
    1j,
]


@pytest.mark.parametrize("value, expected", REAL, ids=[repr(v) for v, _ in REAL])
def test_real_number_types_are_rewards(value, expected):
    assert _real(value) == expected


@pytest.mark.parametrize("value", NOT_REAL, ids=[repr(v) for v in NOT_REAL])
def test_other_values_are_not(value):
    assert _real(value) is None


def test_none_is_not_applicable():
    assert math.isnan(_real(None))


def test_a_reward_that_exits_is_named():
    def quits(prompts, completions, **_):
        raise SystemExit(3)

    with pytest.raises(UserError, match=r"reward function quits called sys.exit\(3\)"):
        _call_checked(quits, "quits", ["p"], ["c"], {})


def test_a_reward_that_hangs_names_the_sample_it_was_on():
    def hangs(prompts, completions, **_):
        for c in completions:
            if c == "bad":
                time.sleep(60)
        return [1.0] * len(completions)

    with pytest.raises(UserError) as e:
        _call_checked(hangs, "hangs", ["p0", "p1", "p2"], ["ok", "bad", "ok"], {}, timeout=0.3)
    text = str(e.value)
    assert "did not return within 0.3 s (reward.timeout) on sample 1 (prompt 'p1', completion 'bad')" in text
    assert f"{__file__}:" in text and "--set reward.timeout=" in text
