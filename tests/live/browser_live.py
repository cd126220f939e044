#!/usr/bin/env python3
# torchdbg — module hooks and a training debugger for LibTorch.
# SPDX-License-Identifier: MIT
"""The demo's live page in headless Chromium, driven over the DevTools protocol (Debian's
chromium and python3-websocket): the page loads and shows the step advancing, the health pause
brings the diagnosis and its causal graph onto the page, clicking Resume lets the run finish,
and requests the page's script makes without the token, or a GET on /pause, are refused.
Keeps a screenshot of the paused page in OUT_DIR/live-paused.png.

    browser_live.py TRAINING_LOOP WORK_DIR OUT_DIR
Prints "SKIPPED: ..." and exits 0 when chromium or python3-websocket is missing.
"""
import json
import base64
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.dont_write_bytecode = True  # nothing written into the source tree
import live_demo  # noqa: E402

try:
    import websocket
except ImportError:
    print("SKIPPED: python3-websocket not installed (scripts/setup.sh installs it when it can)")
    sys.exit(0)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
if not CHROMIUM:
    print("SKIPPED: chromium not found (scripts/setup.sh installs Debian's chromium when it can)")
    sys.exit(0)

procs = []


def fail(msg, out=None):
    for p in procs:
        p.kill()
    sys.stderr.write("browser_live: " + msg + "\n")
    if out:
        sys.stderr.write("".join(out[-30:]))
    sys.exit(1)


class DevTools:
    def __init__(self, ws_url):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0
        self.errors = []

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("method") == "Runtime.exceptionThrown":
                self.errors.append(msg["params"]["exceptionDetails"].get("text", "exception"))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    fail("%s failed: %s" % (method, msg["error"]))
                return msg.get("result", {})

    def eval(self, expression, await_promise=False):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=await_promise)
        if "exceptionDetails" in r:
            fail("page script failed: %s" % r["exceptionDetails"])
        return r["result"].get("value")


def main():
    exe, work, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out_dir, exist_ok=True)
    demo, out, url = live_demo.start(exe, work)
    procs.append(demo)
    if url is None:
        fail("the demo printed no live page address", out)

    profile = tempfile.mkdtemp(prefix="torchdbg-chromium-")
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                "--no-first-run", "--disable-extensions", "--disable-background-networking",
                                "--remote-debugging-port=0", "--user-data-dir=" + profile,
                                "--window-size=1200,2200", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(browser)
    port_file, t0 = os.path.join(profile, "DevToolsActivePort"), time.time()
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        if time.time() - t0 > 60:
            fail("chromium did not open its DevTools port", out)
        time.sleep(0.1)
    port = open(port_file).read().split()[0]
    targets = json.loads(urllib.request.urlopen("http://127.0.0.1:%s/json" % port, timeout=30).read())
    page = next(t for t in targets if t.get("type") == "page")
    dt = DevTools(page["webSocketDebuggerUrl"])
    dt.call("Runtime.enable")
    dt.call("Page.enable")
    dt.call("Page.navigate", url=url)

    # The step advances on the page, then the run pauses and the page shows why.
    seen, state, t0 = set(), None, time.time()
    probe = ("JSON.stringify({step: document.body ? document.body.getAttribute('data-step') : null,"
             " paused: document.body ? document.body.getAttribute('data-paused') : null,"
             " graph: !!document.getElementById('causal-graph'), heatmap: !!document.getElementById('heatmap-plot'),"
             " diagnosis: (document.getElementById('diagnosis') || {}).textContent || '',"
             " bar: (document.getElementById('run-state') || {}).textContent || ''})")
    while time.time() - t0 < 300:
        state = json.loads(dt.eval(probe) or "{}")
        if state.get("step"):
            seen.add(state["step"])
        if state.get("paused") == "1" and state.get("graph"):
            break
        if demo.poll() is not None:
            fail("the demo ended before the page showed a pause", out)
        time.sleep(0.2)
    else:
        fail("the page showed no pause with a causal graph within 300 s (last: %s)" % state, out)
    if len(seen) < 3:
        fail("the page showed only %d different steps before the pause" % len(seen), out)
    if "Most likely cause" not in state["diagnosis"] or state["bar"] != "paused" or not state["heatmap"]:
        fail("the paused page lacks the diagnosis, the state or the heatmap: %s" % state, out)
    shot = dt.call("Page.captureScreenshot", format="png")
    png = os.path.join(out_dir, "live-paused.png")
    with open(png, "wb") as f:
        f.write(base64.b64decode(shot["data"]))

    # From the page's own origin: no token, or a GET on a state-changing route, is refused.
    refusals = dt.eval("Promise.all([fetch('/state').then(r => r.status),"
                       " fetch('/sections?token=' + 'x'.repeat(32)).then(r => r.status),"
                       " fetch('/pause' + location.search).then(r => r.status),"
                       " fetch('/pause', {method: 'POST'}).then(r => r.status),"
                       " fetch('/../../etc/passwd' + location.search).then(r => r.status)])", await_promise=True)
    if refusals != [403, 403, 405, 403, 404]:
        fail("refusals from the page: %s, expected [403, 403, 405, 403, 404]" % refusals, out)

    # Resume: the button clears the flag; the demo restores its checkpoint and finishes.
    dt.eval("document.getElementById('resume').click(); true")
    try:
        rc = demo.wait(300)
    except subprocess.TimeoutExpired:
        fail("the demo did not finish after Resume was clicked", out)
    text = "".join(out)
    if rc != 0 or "finished 400 steps" not in text:
        fail("the demo ended with %d" % rc, out)
    if dt.errors:
        fail("the page threw: %s" % dt.errors, out)
    browser.kill()
    shutil.rmtree(profile, ignore_errors=True)
    print("browser_live: %d steps seen, paused with the diagnosis shown, refusals %s, resumed by a click; "
          "screenshot %s (%d bytes)" % (len(seen), refusals, png, os.path.getsize(png)))


main()
