"""The denoising playground: its page and assets, `GET /v1/clover/modes`, and the provisional events
it streams (`stream_options.provisional`, a clover extension of the SSE stream), with fastapi's
TestClient; then, opt-in (CLOVER_SLOW=1), the page itself in a real browser: Debian's chromium
driven by selenium against a live uvicorn on 127.0.0.1.

The browser test installs what it lacks (selenium from PyPI, `apt-get install chromium
chromium-driver` when run as root) and skips, saying why, when it cannot. With
CLOVER_PLAYGROUND_SHOTS=DIR it also saves the screenshots the docs show (docs/img/playground-*.png)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

KEY = "pg-key"


@pytest.fixture(scope="module")
def app(tiny_llm):
    from clover.serve import create_app

    return create_app(tiny_llm, model_name="tiny", api_key=KEY)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _events(client, path: str, body: dict) -> tuple[list[dict], str]:
    """POST a streamed request: (every `data:` object before [DONE], the raw stream)."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    datas = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]], raw


def _clover(events: list[dict], kind: str) -> list[dict]:
    return [e["clover"] for e in events if "clover" in e and e["clover"]["event"] == kind]


# ---------------------------------------------------------------------------------- the page
def test_page_and_assets_are_served_without_a_key(app):
    anon = TestClient(app)  # no Authorization header; not entered: the app's lifespan is the module's
    if True:
        for path in ("/", "/playground"):
            r = anon.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert 'src="playground/playground.js"' in r.text and 'href="playground/playground.css"' in r.text
            assert "script-src 'self'" in r.headers["content-security-policy"]
        js = anon.get("/playground/playground.js")
        css = anon.get("/playground/playground.css")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        for bad in ("/playground/app.py", "/playground/..%2Fapp.py", "/playground/index.html.bak"):
            r = anon.get(bad)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert anon.get("/v1/clover/modes").status_code == 401  # the API keeps its key
    # offline: nothing loaded from elsewhere, no inline script, and no mode list baked into the page
    static = Path(__file__).parents[1] / "src" / "clover" / "serve" / "static"
    for f in static.iterdir():
        text = f.read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, f.name
    assert "<script>" not in (static / "index.html").read_text()
    from clover.decoding import mode_names

    js_text = (static / "playground.js").read_text()
    assert not any(f'"{m}"' in js_text for m in mode_names()), "modes come from /v1/clover/modes"
    assert "/playground" not in json.dumps(app.openapi()["paths"])  # the page is not part of the API


def test_modes_endpoint_reads_the_registry(client, tiny_llm):
    from clover.decoding import get_mode, mode_names
    from clover.decoding.acceptance import FALLBACKS, POLICIES

    info = client.get("/v1/clover/modes").json()
    assert [m["id"] for m in info["data"]] == list(mode_names())
    assert info["default"] == "diffusion" and info["model"] == "tiny"
    for m in info["data"]:
        assert m["reference"] == get_mode(m["id"]).reference
        assert m["available"] == (not getattr(get_mode(m["id"]), "needs_drafter", False)  # no drafter loaded here
                                  and get_mode(m["id"]).available(tiny_llm.config))  # canvas: whole-sequence models
    opts = info["options"]
    assert opts["policy"]["choices"] == list(POLICIES) and opts["fallback"]["choices"] == list(FALLBACKS)
    assert opts["block_size"]["default"] == tiny_llm.config.block_size
    assert opts["threshold"]["default"] == tiny_llm.config.threshold
    assert opts["max_new_tokens"]["ge"] == 0 and opts["temperature"]["le"] == 100


# ------------------------------------------------------------------------ provisional events
@pytest.mark.parametrize("threshold", [None, 1.5])  # 1.5: nothing ever reaches it, every step is forced
def test_provisional_stream_is_well_formed_and_ends_as_the_plain_answer(client, tiny_llm, threshold):
    body = {"prompt": "def f(x):", "max_tokens": 20, "temperature": 0, "mode": "diffusion", "block_size": 8,
            "ignore_eos": True, "threshold": threshold}
    plain = client.post("/v1/completions", json=body).json()
    events, _ = _events(client, "/v1/completions", {**body, "stream": True, "stream_options": {"provisional": True}})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == plain["choices"][0]["text"]
    ref = tiny_llm.generate("def f(x):", mode="diffusion", max_new_tokens=20, block_size=8, ignore_eos=True,
                            **({"threshold": threshold} if threshold else {}))
    assert text == ref.text

    for e in events:  # an extension chunk is an ordinary chunk with no choices
        assert e["object"] == "text_completion" and e["model"] == "tiny"
        assert ("clover" in e) == (e["choices"] == [])
    prov, commits, done = _clover(events, "provisional"), _clover(events, "commit"), _clover(events, "done")

    # each denoise step: the whole block, masked positions null (text and step too), never undone
    last: dict[int, dict] = {}
    saw_intermediate = False
    for p in prov:
        ids, pieces, steps = p["token_ids"], p["pieces"], p["steps"]
        assert len(ids) == len(pieces) == len(steps) == 8
        assert [t is None for t in ids] == [s is None for s in pieces] == [s == 0 for s in steps]
        prev = last.get(p["block"])
        if prev is None:
            assert p["step"] == 1
        else:
            assert p["step"] == prev["step"] + 1
            assert all(a is None or a == b for a, b in zip(prev["token_ids"], ids))
        decoded = [t for t in ids if t is not None]
        assert decoded and all(0 < s <= p["step"] for s in steps if s)
        saw_intermediate |= 0 < len(decoded) < 8
        last[p["block"]] = p
    assert saw_intermediate
    assert sorted(last) == list(range(len(last))) and len(last) == 3  # 20 tokens in blocks of 8

    # the commits: the output's tokens, with the step that decoded each and the forced ones
    tokens = [t for c in commits for t in c["token_ids"]]
    assert tokens == ref.token_ids
    assert [s for c in commits for s in c["steps"]] == ref.decode_steps
    forced = [i for i, f in enumerate(f for c in commits for f in c["forced"]) if f]
    assert forced == ref.forced_tokens and done[0]["forced_tokens"] == ref.forced_tokens
    if threshold:
        assert forced == list(range(20))
    for c, b in zip(commits, sorted(last)):  # a block's last state is what it commits
        assert last[b]["token_ids"][: len(c["token_ids"])] == c["token_ids"]
        assert c["pieces"] == [tiny_llm.tokenizer.decode([t]) for t in c["token_ids"]]

    stats = done[0]["stats"]
    assert len(done) == 1 and done[0]["finish_reason"] == "length"
    assert stats["forwards"] == plain["clover"]["stats"][0]["forwards"] == len(prov)  # one step per forward
    assert stats["tokens"] == 20 and stats["forced_steps"] == plain["clover"]["stats"][0]["forced_steps"]


def test_provisional_stream_chat_and_ar_and_opt_in(client):
    msgs = [{"role": "user", "content": "Say hi"}]
    body = {"messages": msgs, "max_tokens": 10, "temperature": 0, "mode": "ar"}
    plain = client.post("/v1/chat/completions", json=body).json()
    events, _ = _events(client, "/v1/chat/completions",
                        {**body, "stream": True, "stream_options": {"provisional": True, "include_usage": True}})
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == \
        plain["choices"][0]["message"]["content"]
    assert not _clover(events, "provisional")  # AR has no denoise steps: one commit per token
    commits = _clover(events, "commit")
    assert all(len(c["token_ids"]) == 1 and c["steps"] == [1] and c["forced"] == [False] for c in commits)
    done = _clover(events, "done")[0]
    assert done["stats"]["forwards"] == plain["clover"]["stats"][0]["forwards"]
    assert all(e["object"] == "chat.completion.chunk" and "usage" in e for e in events)

    # not asked for: a plain OpenAI stream, and a non-streamed request ignores the option
    body = {"prompt": "x", "max_tokens": 6, "temperature": 0, "mode": "diffusion", "ignore_eos": True}
    events, raw = _events(client, "/v1/completions", {**body, "stream": True})
    assert '"clover"' not in raw and all(e["choices"] for e in events)
    r = client.post("/v1/completions", json={**body, "stream_options": {"provisional": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == client.post("/v1/completions", json=body).json()["choices"][0]["text"]


def test_provisional_rows_ride_their_own_engine(app, client):
    """A provisional request's rows get an engine that reports every step; plain rows of the same
    group keep theirs (which skips that work)."""
    import dataclasses

    sched = app.state.scheduler
    seen = []
    make = sched._make_engine

    def spy(spec):
        eng = make(spec)
        seen.append((spec, eng.provisional))
        return eng

    sched._make_engine = spy
    try:
        body = {"prompt": "ab", "max_tokens": 4, "temperature": 0, "mode": "diffusion", "ignore_eos": True,
                "block_size": 5}  # a group no other test opens
        client.post("/v1/completions", json=body)
        _events(client, "/v1/completions", {**body, "stream": True, "stream_options": {"provisional": True}})
    finally:
        sched._make_engine = make
    assert [p for _, p in seen] == [False, True] and seen[1][0] == dataclasses.replace(seen[0][0], provisional=True)


# ------------------------------------------------------------------------------ in a browser
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _browser_tools() -> tuple[str, str]:
    """(chromium, chromedriver) paths, installing Debian's packages and selenium when missing."""
    def find():
        return (shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver"))

    chromium, driver = find()
    if not (chromium and driver):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.skip("needs Debian's chromium and chromium-driver: apt-get install -y chromium chromium-driver")
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        done = subprocess.run(["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"], capture_output=True, text=True)
        chromium, driver = find()
        if not (chromium and driver):
            pytest.skip(f"could not install chromium: {done.stderr[-300:]}")
    try:
        import selenium  # noqa: F401
    except ImportError:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "selenium"], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"could not install selenium: {done.stderr[-300:]}")
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = _browser_tools()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,820",
                "--force-device-scale-factor=1", "--proxy-server=direct://", "--proxy-bypass-list=*"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(options=opts, service=Service(driver_path))
    drv.set_script_timeout(30)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def live(browser):
    """A live server on 127.0.0.1 with the bundled model (the tiny random one when it is absent),
    with an API key, so the page's key handling is part of the test."""
    import clover
    from clover.api import BUNDLED_MODEL
    from clover.serve import create_app
    from clover.serve.app import uvicorn_server

    if (BUNDLED_MODEL / "config.json").exists():
        llm = clover.load()
    else:
        from clover.tiny import build_tiny_checkpoint
        import tempfile

        llm = clover.load(build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "model", seed=0))
    port = _free_port()
    app = create_app(llm, model_name="clover-tiny", api_key=KEY)
    server = uvicorn_server(app, host="127.0.0.1", port=port, log_level="warning", graceful=5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", llm
    server.should_exit = True
    thread.join(timeout=30)


SNAPSHOT = """return [...document.querySelectorAll('.run')].map(r => ({
  mode: r.dataset.mode, state: r.dataset.state,
  masked: r.querySelectorAll('.block .tok.mask').length,
  decoded: r.querySelectorAll('.block .tok:not(.mask)').length,
  committed: r.querySelectorAll('.committed .tok').length,
  text: r.querySelector('.text').textContent,
  forwards: r.querySelector('[data-stat="forwards"]').textContent,
  badge: r.querySelector('.badge').hidden ? null : r.querySelector('.badge').textContent,
  error: r.querySelector('.error').hidden ? null : r.querySelector('.error').textContent}))"""


def _until_done(drv, timeout: float = 120, on_poll=None) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = drv.execute_script(SNAPSHOT)
        if on_poll:
            on_poll(runs)
        if runs and all(r["state"] in ("done", "error") for r in runs) and not drv.find_element("id", "run").get_property("disabled"):
            return runs
        time.sleep(0.03)
    raise AssertionError(f"the page did not finish: {drv.execute_script(SNAPSHOT)}")


def _api(base: str, body: dict) -> dict:
    import httpx

    r = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _shot(drv, name: str) -> None:
    """With CLOVER_PLAYGROUND_SHOTS=DIR: save the viewport as DIR/name, made small (128 colours)."""
    out = os.environ.get("CLOVER_PLAYGROUND_SHOTS")
    if not out:
        return
    path = Path(out) / name
    drv.save_screenshot(str(path))
    try:
        from PIL import Image

        Image.open(path).convert("RGB").quantize(128, dither=Image.Dither.NONE).save(path, optimize=True)
    except ImportError:
        pass
    print(f"screenshot: {path} ({path.stat().st_size // 1024} KB)")


@pytest.mark.slow
def test_playground_in_chromium(browser, live):
    from selenium.webdriver.common.keys import Keys

    base, llm = live
    drv = browser
    prompt = "assert sorted([9, 2, 5]) == "

    # 1. the page loads; the server wants a key, so the page asks for it and keeps it for this tab
    drv.get(base + "/")
    assert "clover" in drv.title
    deadline = time.monotonic() + 20
    while not drv.find_element("id", "auth").get_property("open"):
        assert time.monotonic() < deadline, "the page did not ask for the API key"
        time.sleep(0.05)
    key = drv.switch_to.active_element
    assert key.get_attribute("id") == "api_key"  # focus moved there: keyboard-only users land on it
    key.send_keys(KEY, Keys.TAB)
    deadline = time.monotonic() + 20
    while not drv.find_elements("css selector", 'input[name="mode"]'):
        assert time.monotonic() < deadline, "the modes did not load after the key"
        time.sleep(0.05)
    from clover.decoding import mode_names

    boxes = drv.find_elements("css selector", 'input[name="mode"]')
    assert [b.get_attribute("value") for b in boxes] == list(mode_names())
    assert drv.execute_script("return sessionStorage.getItem('clover.apiKey')") == KEY
    assert KEY not in drv.current_url

    # keyboard only: type a prompt and run it with Ctrl+Enter
    area = drv.find_element("id", "prompt")
    area.click()
    area.send_keys("def add(a, b):")
    max_tokens = drv.find_element("id", "max_tokens")
    max_tokens.clear()
    max_tokens.send_keys("8")
    area.send_keys(Keys.CONTROL, Keys.ENTER)
    runs = _until_done(drv)
    assert runs[0]["state"] == "done" and runs[0]["text"], runs
    assert "prompt=def+add" in drv.current_url or "prompt=def%20add" in drv.current_url

    # 2. an autorun link (greedy by default) gives the API's text, and shows the block denoising:
    # a current block with tokens decoded and positions still masked
    q = {"prompt": prompt, "mode": "diffusion", "max_tokens": "64", "pace": "80", "autorun": "1"}
    drv.get(base + "/?" + urllib.parse.urlencode(q))
    states, shot = [], []

    def watch(runs):
        r = runs[0] if runs else None
        if r and r["state"] == "running" and r["masked"] and r["decoded"]:
            if r["committed"] and r["decoded"] >= 6 and not shot:  # a block committed, the next one half-way
                shot.append(_shot(drv, "playground-denoising.png"))
            states.append((r["masked"], r["decoded"], r["committed"]))

    runs = _until_done(drv, on_poll=watch)
    api = _api(base, {"prompt": prompt, "mode": "diffusion", "max_tokens": 64, "temperature": 0})
    assert runs[0]["text"] == api["choices"][0]["text"], (runs[0]["text"], api["choices"][0]["text"])
    assert runs[0]["forwards"] == str(api["clover"]["stats"][0]["forwards"])
    assert len(set(states)) >= 3, f"too few intermediate states seen: {states}"
    print(f"\nlive view: {len(states)} polls caught a block mid-denoise, {len(set(states))} distinct "
          f"(masked, decoded, committed) states, e.g. {states[:3]}")
    print(f"autorun text == API text: {runs[0]['text']!r}")

    # 3. side by side: three modes at once; each forwards count is the API's, and speculative
    # (lossless) carries the badge: the same text as AR
    modes = ["ar", "diffusion", "speculative"]
    q = {"prompt": prompt, "mode": ",".join(modes), "max_tokens": "64", "autorun": "1"}
    drv.get(base + "/?" + urllib.parse.urlencode(q))
    runs = _until_done(drv)
    _shot(drv, "playground-side-by-side.png")
    assert [r["mode"] for r in runs] == modes
    for r in runs:
        api = _api(base, {"prompt": prompt, "mode": r["mode"], "max_tokens": 64, "temperature": 0})
        stats = api["clover"]["stats"][0]
        assert r["state"] == "done" and r["error"] is None, r
        assert r["forwards"] == str(stats["forwards"]), (r["mode"], r["forwards"], stats["forwards"])
        assert r["text"] == api["choices"][0]["text"], r["mode"]
        print(f"side by side {r['mode']}: forwards {r['forwards']} (API {stats['forwards']}), badge {r['badge']!r}")
    spec = next(r for r in runs if r["mode"] == "speculative")
    assert spec["badge"] == "✓ same text as ar"

    # 4. a phone's width: one column, nothing wider than the screen
    drv.set_window_size(390, 844)
    time.sleep(0.3)
    width = drv.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], width
    cols = drv.execute_script("return getComputedStyle(document.getElementById('runs')).gridTemplateColumns.split(' ').length")
    assert cols == 1
    drv.set_window_size(1400, 820)
