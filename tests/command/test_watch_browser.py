"""The watch page in a real Chromium (Debian's chromium and chromium-driver, driven by selenium), as a user
uses it: the page of a running character model (flowvm/programs/charlm.py, whose loop reads its ``lr``
register at every iteration) shows the cursor moving and the loss curve growing; pause stops the steps, step
takes one more, fork with lr=0.01 writes a checkpoint that resumes at that rate, stop saves one that resumes
exactly (where an uninterrupted run is after as many steps), and the page, its port closed, says the run does
not answer.  The page of a running mlp (whose learning rate lives in its optimizer, not a register) shows its
cursor and loss curve, pauses, steps and stops to a checkpoint that resumes exactly.  With FLOWVM_SCREENSHOT=PATH it also writes a screenshot of the page there (docs/watch.png)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

import flowvm
from flowvm.testing import diff, outcome

from toy import flowvm_cmd
from watching import Watched

CHARLM = ["run", "charlm", "--set", "iters=100000", "--set", "n_layer=1", "--set", "n_embd=16", "--set", "block=16",
          "--set", "batch_size=4", "--set", "eval_every=25", "--set", "eval_iters=2", "--set", "max_bytes=100000"]


@pytest.fixture
def browser():
    from selenium import webdriver

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    assert chromium and driver_path, "install Debian's chromium and chromium-driver (apt-get install chromium " \
                                     "chromium-driver): .ci/run does"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    drv = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    yield drv
    drv.quit()


def _wait(check, timeout=60.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"waited {timeout} s for {what}")


def test_a_user_watches_pauses_steps_forks_and_stops_a_run_in_chromium(browser, tmp_path):
    from selenium.webdriver.common.by import By

    ckpt, fork = tmp_path / "run.ckpt", tmp_path / "fork.ckpt"
    w = Watched(*CHARLM, "--checkpoint", ckpt)
    try:
        browser.get(w.url)
        # read through the page's own DOM at once: the page redraws its parts twice a second
        text = lambda css: browser.execute_script(  # noqa: E731
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css)
        steps = lambda: int(text("#steps"))  # noqa: E731
        _wait(lambda: steps() > 0, what="the first steps on the page")
        assert "charlm" in text("#program") and "torch" in text("#versions")
        cursors = set()
        _wait(lambda: cursors.add(text("#listing .cursor")) or len(cursors) >= 3, what="the cursor moving")
        assert any("loss" in c or "model(" in c or "lr_at" in c or "next(" in c for c in cursors), cursors

        def points():
            return int(browser.execute_script(
                "const e = document.querySelector('.plot[data-name=\"it\"]'); return e ? e.dataset.points : 0;"))

        first = _wait(points, what="a plot")
        _wait(lambda: points() > first + 3, what="the plot growing")
        assert "lr" in browser.execute_script(
            "return [...document.querySelectorAll('#registers tr')].map(r => r.dataset.name);")

        browser.find_element(By.ID, "pause").click()
        _wait(lambda: text("#state") == "paused", what="paused")
        held = steps()
        time.sleep(1.0)
        assert steps() == held and w.state()["steps"] == held  # no step while paused

        browser.find_element(By.ID, "step").click()
        _wait(lambda: steps() == held + 1, what="one more step")
        time.sleep(0.5)
        assert steps() == held + 1

        browser.find_element(By.ID, "fork-path").send_keys(str(fork))
        browser.find_element(By.ID, "fork-registers").send_keys("lr=0.01")
        browser.find_element(By.ID, "fork").click()
        _wait(lambda: "forked to" in text("#message"), what="the fork")
        if os.environ.get("FLOWVM_SCREENSHOT"):
            browser.find_element(By.ID, "run").click()  # the page as it looks while the run goes on
            _wait(lambda: steps() > held + 30, what="the run going on")
            browser.find_element(By.ID, "pause").click()
            _wait(lambda: text("#state") == "paused", what="paused")
            browser.execute_script("window.scrollTo(0, 0)")
            time.sleep(0.6)
            browser.save_screenshot(os.environ["FLOWVM_SCREENSHOT"])

        browser.find_element(By.ID, "stop").click()
        _wait(lambda: "stopped" in text("#message") or w.proc.poll() is not None, what="the stop")
        code, out, err = w.finish()
        # the run has ended and its port is closed: the page, still open, says so
        _wait(lambda: "the run does not answer" in text("#message"), what="the page noticing the closed port")
    finally:
        w.kill()
    assert code == 0 and "paused at step" in out, err

    forked = flowvm.load(fork)
    assert forked.registers["lr"] == 0.01 and not forked.done
    flowvm_cmd("resume", fork, "--max-steps", 40, "--progress", "none")
    assert flowvm.load(fork).registers["lr_now"] <= 0.01  # the schedule goes on from the new rate

    # the stopped run, resumed for 200 steps, is where an uninterrupted run is after as many steps
    stopped = flowvm.read_header(ckpt)["steps"]
    flowvm_cmd("resume", ckpt, "--max-steps", 200, "--progress", "none")
    flowvm_cmd(*CHARLM, "--checkpoint", tmp_path / "straight.ckpt", "--max-steps", stopped + 200, "--progress", "none")
    assert not diff(outcome(flowvm.load(tmp_path / "straight.ckpt")), outcome(flowvm.load(ckpt)))


def test_the_page_of_a_running_mlp_shows_its_cursor_and_loss_curve_and_its_stop_resumes_exactly(browser, tmp_path):
    # the bundled mlp: its learning rate lives in its optimizer, not in a register, so the fork with lr=0.01
    # is the test above's; here the page, pause, step and stop
    mlp = ["run", "mlp", "--set", "epochs=100000", "--set", "samples=600", "--set", "hidden=16"]
    ckpt = tmp_path / "mlp.ckpt"
    w = Watched(*mlp, "--checkpoint", ckpt)
    try:
        browser.get(w.url)
        text = lambda css: browser.execute_script(  # noqa: E731
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css)
        steps = lambda: int(text("#steps") or 0)  # noqa: E731
        cursors = set()
        training = lambda: any("train_step" in c or "next_batch" in c for c in cursors)  # noqa: E731
        # the cursor moves, and is seen on a training step (not only on an evaluation, which the WEAVE interleaves)
        _wait(lambda: cursors.add(text("#listing .cursor")) or len(cursors) >= 2 and training(),
              what="the cursor moving onto a training step")
        points = lambda: int(browser.execute_script(  # noqa: E731
            "const e = document.querySelector('.plot[data-name=\"loss\"]'); return e ? e.dataset.points : 0;"))
        first = _wait(points, what="the loss curve")
        _wait(lambda: points() > first, what="the loss curve growing")
        browser.find_element("id", "pause").click()
        _wait(lambda: text("#state") == "paused", what="paused")
        held = steps()
        time.sleep(1.0)
        assert steps() == held == w.state()["steps"]
        browser.find_element("id", "step").click()
        _wait(lambda: steps() == held + 1, what="one more step")
        browser.find_element("id", "stop").click()
        code, out, err = w.finish()
    finally:
        w.kill()
    assert code == 0 and f"paused at step {held + 1}" in out, err
    flowvm_cmd("resume", ckpt, "--max-steps", 300, "--progress", "none")
    flowvm_cmd(*mlp, "--checkpoint", tmp_path / "straight.ckpt", "--max-steps", held + 301, "--progress", "none")
    assert not diff(outcome(flowvm.load(tmp_path / "straight.ckpt")), outcome(flowvm.load(ckpt)))
