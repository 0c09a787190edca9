"""The chat page at GET / in a real headless Chromium (Debian's chromium + chromium-driver, through selenium):
type a message, see streamed text arrive, stop a long answer. The page needs nothing from outside the server."""

from __future__ import annotations

import os
import re
import shutil

import pytest

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="Chromium and ChromeDriver are not installed "
                                "(Debian: apt-get install chromium chromium-driver; .ci/run installs them)")
SCREENSHOT = os.environ.get("K3_CHAT_SCREENSHOT")  # where to keep a screenshot (docs/chat.png), if anywhere


def test_the_page_has_no_outside_urls(server):
    status, _, page = server.request("GET", "/")
    assert status == 200 and "<title>k3 chat</title>" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page) and "http" not in page.replace("http-equiv", "")


@pytest.fixture
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1000,700", "--no-first-run", "--disable-extensions"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_typing_a_message_streams_an_answer(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    browser.find_element(By.ID, "key").send_keys("sekret")
    browser.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").text == "tiny")
    browser.find_element(By.ID, "max").clear()
    browser.find_element(By.ID, "max").send_keys("64")  # two turns of a random model stay inside the 1,024 context
    browser.find_element(By.ID, "input").send_keys("Who art thou?", Keys.ENTER)
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant span")
               and d.find_element(By.CSS_SELECTOR, ".msg.assistant span").text.strip())
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Who art thou?"
    wait.until(lambda d: d.find_element(By.ID, "stop").get_attribute("disabled"))  # the answer ended
    if SCREENSHOT:
        browser.save_screenshot(SCREENSHOT)
    # a second turn, long enough to be stopped: Stop ends the stream early and the page is ready again
    browser.find_element(By.ID, "max").clear()
    browser.find_element(By.ID, "max").send_keys("600")
    browser.find_element(By.ID, "input").send_keys("Say more.", Keys.ENTER)
    wait.until(lambda d: not d.find_element(By.ID, "stop").get_attribute("disabled"))
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda d: d.find_element(By.ID, "stop").get_attribute("disabled"))
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
