"""Notebook 01 in JupyterLab in a real browser: run it, type a prompt, watch the text stream in.

JupyterLab runs on a free loopback port in its own process session; Playwright drives Debian's
Chromium (``/usr/bin/chromium``, never a browser that ``playwright install`` downloads). The
notebook is a copy of the shipped one in ``tmp_path`` with its ``RUN_DIR`` parameter set there
and without its last cell (``server.stop()``), so the server is still up when the prompt box is
used; shutting JupyterLab down must then end the kernel, the Triton server it started and the
server's stub processes: the test checks with psutil that none is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

from labkit.proc import free_port

playwright = pytest.importorskip("playwright.sync_api")  # the test extra: pip install playwright

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_deploy_transformer.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NOTEBOOK_RUN_S = 240  # kernel start, server start, the notebook's own requests, on 2 busy cores
PROMPT = "Where is the nearest"


def notebook_copy(folder: Path) -> Path:
    """The shipped notebook with ``RUN_DIR`` in ``folder`` and without its final stop cell."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    stop = [i for i, c in enumerate(nb.cells) if "server.stop()" in c.source]
    assert stop == [len(nb.cells) - 1], "notebook 01 should end with its server.stop() cell"
    del nb.cells[-1]
    parameters = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    parameters.source += f"\nRUN_DIR = {str(folder / 'run')!r}\nMAX_TOKENS = 12\n"
    path = folder / NOTEBOOK.name
    nbformat.write(nb, path)
    return path


@contextlib.contextmanager
def jupyterlab(folder: Path):
    """``(url, token, process)`` of a JupyterLab in ``folder``; shut down and checked after."""
    port, token = free_port(), secrets.token_hex(16)
    settings = folder / ".settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)  # no "get notified about Jupyter news?" toast over the page
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(folder / ".jupyter"),
        "JUPYTER_RUNTIME_DIR": str(folder / ".runtime"),
        "JUPYTERLAB_WORKSPACES_DIR": str(folder / ".workspaces"),
        "JUPYTERLAB_SETTINGS_DIR": str(folder / ".settings"),
    }
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={folder}",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--ServerApp.terminals_enabled=False",
        *(["--allow-root"] if os.geteuid() == 0 else []),  # CI and these machines run as root
    ]
    with open(folder / "jupyterlab.log", "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{log_tail(folder)}")
                time.sleep(0.5)
        yield url, token, process, seen
    finally:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(process.pid).children(recursive=True):
                seen.setdefault(child.pid, child)
        request = urllib.request.Request(
            f"{url}/api/shutdown", method="POST", headers={"Authorization": f"token {token}"}
        )
        with contextlib.suppress(OSError):
            urllib.request.urlopen(request, timeout=30).close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        _, alive = psutil.wait_procs(list(seen.values()), timeout=60)
        for leftover in alive:  # only processes this test started, by pid
            with contextlib.suppress(psutil.Error):
                leftover.kill()
        assert not alive, f"left running after JupyterLab shut down: {describe(alive)}"


def _command_lines(processes) -> list[str]:
    """Each process's command line; one that ends meanwhile is left out, not an error."""
    lines = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            lines.append(" ".join(p.cmdline()))
    return lines


def describe(processes) -> str:
    names = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            names.append(f"{p.pid} {' '.join(p.cmdline()[:2])}")
    return ", ".join(names)


def log_tail(folder: Path, lines: int = 30) -> str:
    path = folder / "jupyterlab.log"
    return (
        "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
    )


def run_all_cells(page) -> None:
    """Run > Run All Cells once the kernel is idle; again if no cell started (a click too early)."""
    started = page.locator(".jp-InputArea-prompt").filter(has_text=re.compile(r"\[(\*|\d+)\]"))
    for _attempt in range(3):
        page.get_by_text(re.compile(r"\| Idle$")).first.wait_for(timeout=90_000)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        with contextlib.suppress(playwright.TimeoutError):
            started.first.wait_for(timeout=20_000)
            return
    pytest.fail("JupyterLab did not start running the notebook's cells")


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed")
def test_notebook_01_streams_a_typed_prompt_into_the_widget_in_jupyterlab(tmp_path):
    notebook = notebook_copy(tmp_path)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "notebook01-streaming.png"
    started = time.monotonic()
    with jupyterlab(tmp_path) as (url, token, jupyter, seen), playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/{notebook.name}?token={token}", timeout=90_000)
            page.locator(".jp-Notebook").wait_for(timeout=90_000)
            run_all_cells(page)

            generate = page.locator("button.jupyter-button", has_text="Generate")
            failed = page.locator(".jp-OutputArea-output[data-mime-type*='error']")
            deadline = time.monotonic() + NOTEBOOK_RUN_S
            while not generate.count() and not failed.count() and time.monotonic() < deadline:
                page.wait_for_timeout(500)
            if not generate.count():
                page.screenshot(path=str(shot), full_page=True)
                error = "\n".join(failed.all_inner_texts())[-3000:] or "none shown"
                pytest.fail(f"the prompt box never appeared (screenshot {shot}); error:\n{error}")
            widget = generate.locator("xpath=ancestor::div[contains(@class,'widget-vbox')][1]")
            prompt, output = widget.locator("textarea").nth(0), widget.locator("textarea").nth(1)
            picked = widget.locator("select").input_value()
            # the box opens with its own answer to the tutorial's prompt (the cell presses
            # Generate once, so that a saved run shows one): a learner types once it is done
            status = widget.locator(".widget-html-content").last
            while time.monotonic() < deadline and not (
                generate.is_enabled() and status.inner_text().startswith("done in")
            ):
                page.wait_for_timeout(200)
            opening = status.inner_text()
            prompt.fill(PROMPT)
            generate.scroll_into_view_if_needed()
            generate.click()

            values: list[str] = []
            deadline = time.monotonic() + 120
            while status.inner_text() == opening and time.monotonic() < deadline:
                page.wait_for_timeout(30)  # the click has reached the kernel: a new generation
            while time.monotonic() < deadline:
                value = output.input_value()
                if not values or value != values[-1]:
                    values.append(value)
                shown = status.inner_text()
                if shown and not shown.startswith(("generating", "streaming")):
                    break
                page.wait_for_timeout(30)
            values.append(output.input_value())
            final_status = status.inner_text()
            page.screenshot(path=str(shot), full_page=False)
            print(f"\nscreenshot: {shot}\nstatus: {final_status}\ntext: {values[-1]!r}")
        finally:
            browser.close()
        running = psutil.Process(jupyter.pid).children(recursive=True)
        names = " ".join(_command_lines(running))
        seen.update((p.pid, p) for p in running)
    # the context manager has checked that all of these ended with JupyterLab
    assert "ipykernel" in names and "tritonserver" in names, names
    assert picked == "smollm2_stream"
    assert opening.startswith("done in"), opening  # the box's own first answer, before ours
    assert final_status.startswith("done in") and "first text after" in final_status, final_status
    growing = [v for v in dict.fromkeys(values) if v]
    assert growing[-1].startswith(PROMPT) and len(growing[-1]) > len(PROMPT)
    assert len(growing) > 2, f"the text did not arrive in pieces: {growing}"
    assert all(growing[-1].startswith(v) for v in growing)
    print(f"browser test took {time.monotonic() - started:.0f} s")


def test_notebook_copy_for_the_browser_keeps_every_cell_but_the_stop(tmp_path):
    path = notebook_copy(tmp_path)
    copy, shipped = nbformat.read(path, 4), nbformat.read(NOTEBOOK, 4)
    assert len(copy.cells) == len(shipped.cells) - 1
    assert json.dumps(copy.cells[-1].source) == json.dumps(shipped.cells[-2].source)
    tagged = [c.source for c in copy.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and f"RUN_DIR = {str(tmp_path / 'run')!r}" in tagged[0]
