"""The playground page (``GET /``) in a real browser: headless Chromium, driven by Selenium through
Debian's chromedriver, against ``python -m jaxray.serve`` on a private Ray serving the transformer
trained on real TinyShakespeare bytes by ``tests/conftest.py``. It types a prompt, presses Generate,
and waits for the streamed text and the figures (time to first token, tokens/s): greedy text equals
the non-stream ``/generate`` answer; a bad input shows the server's error message in words. The
screenshot goes to docs/playground.png when JAXRAY_SCREENSHOT is set (the README shows it), else to
tmp_path; either way it must be a PNG under 300 KB."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import requests
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from serve_load import free_port, start_serving

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
MAX_PNG_BYTES = 300_000
NUMBER = re.compile(r"\d+(\.\d+)?")
# Counts the text pieces appended to #output from now on (one mutation record adding text per append).
COUNT_PIECES = """
window.pieces = 0;
if (!window.counter) {
  window.counter = new MutationObserver((records) => {
    window.pieces += records.filter((r) => r.addedNodes.length).length;
  });
  window.counter.observe(document.getElementById("output"), {childList: true});
}
"""

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER),
        reason="needs Debian's chromium and chromium-driver on PATH (.ci/run installs them: "
        "apt-get install chromium chromium-driver)",
    ),
]


@pytest.fixture(scope="module")
def url(trained_transformer):
    """``python -m jaxray.serve`` on a free port; stopped (its private Ray with it) at the end."""
    port = free_port()
    proc = start_serving(trained_transformer, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def chromium(width: int = 1000, height: int = 700) -> webdriver.Chrome:
    """Headless Chromium through Debian's chromedriver (no driver or browser download)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))


@pytest.fixture
def browser():
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


def fill(driver: webdriver.Chrome, **fields: str) -> None:
    """Type each value into the element of that id, replacing what it held."""
    for name, value in fields.items():
        element = driver.find_element(By.ID, name)
        element.clear()
        element.send_keys(value)


def generate(driver: webdriver.Chrome, timeout_s: float = 120) -> dict[str, str]:
    """Press Generate and wait for the figures (or an error); returns the page's text fields."""
    driver.execute_script(COUNT_PIECES)
    driver.find_element(By.ID, "generate").click()

    def finished(d: webdriver.Chrome) -> bool:
        return (
            bool(NUMBER.fullmatch(d.find_element(By.ID, "tps").text))
            or d.find_element(By.ID, "error").is_displayed()
        )

    WebDriverWait(driver, timeout_s).until(finished)
    fields = {name: driver.find_element(By.ID, name).text for name in ("ttft", "tps", "tokens", "error")}
    fields["output"] = driver.execute_script("return document.getElementById('output').textContent")
    fields["pieces"] = driver.execute_script("return window.pieces")
    return fields


def screenshot(driver: webdriver.Chrome, tmp_path: Path) -> Path:
    """The page as a PNG: docs/playground.png when JAXRAY_SCREENSHOT is set, else in tmp_path."""
    path = ROOT / "docs" / "playground.png" if os.environ.get("JAXRAY_SCREENSHOT") else tmp_path / "page.png"
    assert driver.save_screenshot(str(path))
    return path


def test_generate_streams_into_the_page_and_errors_show_in_words(url, browser, tmp_path):
    browser.get(url + "/")
    assert browser.title == "jaxray playground"
    body = {"prompt": "ROMEO:", "max_new_tokens": 40, "temperature": 0, "top_k": None, "seed": 0}
    fill(browser, prompt=body["prompt"], temperature="0", top_k="", max_tokens="40", seed="0")
    shown = generate(browser)
    assert not shown["error"], shown["error"]
    want = requests.post(url + "/generate", json=body, timeout=60).json()["text"]
    assert shown["output"] == want and shown["pieces"] >= 3, shown  # 40 tokens in chunks of 8
    assert shown["tokens"] == "40"
    ttft_ms = shown["ttft"].removesuffix(" ms")
    assert NUMBER.fullmatch(ttft_ms) and int(ttft_ms) > 0 and float(shown["tps"]) > 0, shown
    png = screenshot(browser, tmp_path).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < MAX_PNG_BYTES, len(png)

    fill(browser, max_tokens="0")
    refused = requests.post(url + "/generate", json={**body, "max_new_tokens": 0}, timeout=60)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]  # "max_new_tokens must be in 1..1024, got 0"
    shown = generate(browser)
    assert message in shown["error"] and not shown["output"], shown
