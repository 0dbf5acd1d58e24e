"""``%resilience isolate`` as a JupyterLab user sees it: JupyterLab in headless Chromium (Debian's
``chromium`` and ``chromium-driver``, driven by selenium), Run All on a training notebook whose
worker is SIGKILLed mid-training, no click after that.

Screenshots (after the page loaded, after the kill's marker appeared, at the end) are kept in
``$TEST_ARTIFACTS`` (``.ci/artifacts`` under CI), else in the test's temporary folder. CI installs
the browser and JupyterLab on the newest stack; elsewhere the test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import nbformat
import pytest

from harness import KERNEL_NAME, epochs, load, result, user_cells
from test_isolation_server import TOKEN, jupyter, listed_kernels

pytest.importorskip("jupyterlab")
webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")


@pytest.fixture
def lab(tmp_path):
    with jupyter("jupyterlab", tmp_path, wait=90) as url:
        yield url


@pytest.fixture
def browser(tmp_path):
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def outputs_text(driver) -> str:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('.jp-OutputArea-output')).map(e => e.innerText).join('\\n');")


def test_run_all_in_jupyterlab_finishes_after_a_worker_kill_with_no_click(lab, browser, tmp_path, reference):
    from selenium.webdriver.common.by import By

    shots = Path(os.environ.get("TEST_ARTIFACTS") or tmp_path) / "isolation-browser"
    shots.mkdir(parents=True, exist_ok=True)
    nb = load("train.ipynb", tmp_path, fault="sigkill", fault_epoch=2, staging="off", pause=0.05)
    sources = [s for _, s in user_cells(nb)]
    page = nbformat.v4.new_notebook()
    page.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "tests", "language": "python"}
    page.cells = [nbformat.v4.new_code_cell(s) for s in [sources[0], "%resilience isolate", *sources[1:]]]
    nbformat.write(page, tmp_path / "train.ipynb")

    browser.get(f"{lab}/lab/tree/train.ipynb?token={TOKEN}")
    deadline = time.monotonic() + 120
    # the page shows the notebook, and its kernel (started by the page through the server) is idle
    while not (browser.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")
               and [k["execution_state"] for k in listed_kernels(lab)] == ["idle"]):
        if time.monotonic() > deadline:
            browser.save_screenshot(str(shots / "0-not-loaded.png"))
            raise AssertionError("JupyterLab did not show the notebook with an idle kernel within 120 s")
        time.sleep(0.5)
    browser.save_screenshot(str(shots / "1-loaded.png"))
    browser.find_element(By.XPATH, "//li[contains(@class,'lm-MenuBar-item')][.//div[text()='Run']]").click()
    browser.find_element(By.XPATH, "//li[contains(@class,'lm-Menu-item')][.//div[text()='Run All Cells']]").click()

    dialogs, marker_shot = [], False
    deadline = time.monotonic() + 300
    while "RESULT " not in (text := outputs_text(browser)):
        assert time.monotonic() < deadline, f"Run All did not finish within 300 s:\n{text[-3000:]}"
        dialogs += [d.text for d in browser.find_elements(By.CSS_SELECTOR, ".jp-Dialog")]
        if not marker_shot and "colab_resilience: the kernel died" in text:
            browser.save_screenshot(str(shots / "2-worker-killed.png"))
            marker_shot = True
        time.sleep(0.5)
    browser.save_screenshot(str(shots / "3-done.png"))
    assert not dialogs, dialogs  # no "The kernel appears to have died"
    assert "colab_resilience: the kernel died (killed by SIGKILL); switched to the standby kernel and replayed 3 cells in " in text
    assert result(text) == reference.result
    assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]
    kernels = listed_kernels(lab)
    assert len(kernels) == 1 and kernels[0]["execution_state"] == "idle"


def wait_for(driver, css: str, shots: Path, name: str, timeout: float = 120):
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while not (found := driver.find_elements(By.CSS_SELECTOR, css)):
        if time.monotonic() > deadline:
            driver.save_screenshot(str(shots / f"{name}-missing.png"))
            raise AssertionError(f"no {css} within {timeout:.0f} s:\n{outputs_text(driver)[-2000:]}")
        time.sleep(0.3)
    return found


def test_widgets_of_the_worker_are_drawn_and_answer_in_jupyterlab(lab, browser, tmp_path):
    """tqdm.auto's notebook bar and an ipywidgets slider, made in the worker, are drawn by
    JupyterLab; moving the slider in the page changes the worker's value."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    shots = Path(os.environ.get("TEST_ARTIFACTS") or tmp_path) / "isolation-widgets"
    shots.mkdir(parents=True, exist_ok=True)
    page = nbformat.v4.new_notebook()
    page.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "tests", "language": "python"}
    page.cells = [nbformat.v4.new_code_cell(s) for s in [
        "%load_ext colab_resilience", "%resilience isolate",
        "import time\nfrom tqdm.auto import tqdm\nfor _ in tqdm(range(40), desc='epochs'):\n    time.sleep(0.01)",
        "import ipywidgets as w\nslider = w.IntSlider(value=3, description='lr')\nslider",
        "print('slider at', slider.value, 'in PID', __import__('os').getpid())"]]
    nbformat.write(page, tmp_path / "widgets.ipynb")

    browser.get(f"{lab}/lab/tree/widgets.ipynb?token={TOKEN}")
    wait_for(browser, ".jp-Notebook .jp-Cell", shots, "0-notebook")
    deadline = time.monotonic() + 120
    while [k["execution_state"] for k in listed_kernels(lab)] != ["idle"]:
        assert time.monotonic() < deadline, "the notebook's kernel did not become idle within 120 s"
        time.sleep(0.5)
    browser.find_element(By.XPATH, "//li[contains(@class,'lm-MenuBar-item')][.//div[text()='Run']]").click()
    browser.find_element(By.XPATH, "//li[contains(@class,'lm-Menu-item')][.//div[text()='Run All Cells']]").click()
    deadline = time.monotonic() + 120
    while "slider at 3 in PID" not in outputs_text(browser):
        assert time.monotonic() < deadline, f"Run All did not finish:\n{outputs_text(browser)[-2000:]}"
        time.sleep(0.3)
    [bar] = wait_for(browser, ".widget-hprogress", shots, "1-bar")
    drawn = outputs_text(browser).replace("\u2007", " ")  # tqdm pads with figure spaces
    assert "epochs: 100%" in drawn and " 40/40 " in drawn
    [readout] = wait_for(browser, ".widget-slider .widget-readout", shots, "2-slider")
    browser.save_screenshot(str(shots / "1-drawn.png"))
    # the user types 7 into the slider's readout: the frontend's comm message goes to the worker
    readout.click()
    ActionChains(browser).key_down(Keys.CONTROL).send_keys("a").key_up(Keys.CONTROL).send_keys("7", Keys.ENTER).perform()
    last = browser.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")[-1]
    last.find_element(By.CSS_SELECTOR, ".jp-InputArea-editor").click()
    ActionChains(browser).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    deadline = time.monotonic() + 60
    while "slider at 7 in PID" not in (text := outputs_text(browser)):
        assert time.monotonic() < deadline, f"the slider's new value did not reach the worker:\n{text[-2000:]}"
        time.sleep(0.3)
    browser.save_screenshot(str(shots / "2-moved.png"))
    # it ran in the worker the isolate cell started
    worker = text.split("cells run in worker kernel PID ")[1].split()[0]
    assert text.split("slider at 7 in PID ")[1].split()[0] == worker
    assert "IProgress not found" not in text
