#!/usr/bin/env python3
# torchdbg — module hooks and a training debugger for LibTorch.
# SPDX-License-Identifier: MIT
"""Drives the demo's live page as a user would: `training_loop DIR --live`, then, over HTTP,
watches the step advance, waits for the health pause, checks that the page shows the
diagnosis, presses Resume, and checks that the run then finishes.

    drive_demo.py TRAINING_LOOP WORK_DIR
"""
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.dont_write_bytecode = True  # nothing written into the source tree
import live_demo  # noqa: E402


def fail(msg, proc=None, out=None):
    if proc is not None:
        proc.kill()
    sys.stderr.write("drive_demo: " + msg + "\n")
    if out:
        sys.stderr.write("".join(out[-40:]))
    sys.exit(1)


def request(url, method="GET", token=None):
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token is not None:
        req.add_header("X-Torchdbg-Token", token)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, ""


def main():
    exe, work = sys.argv[1], sys.argv[2]
    proc, out, url = live_demo.start(exe, work)
    if url is None:
        fail("the demo printed no live page address", proc, out)
    m = re.match(r"(http://[^/]+)/\?token=([A-Za-z0-9]+)$", url)
    if not m:
        fail("unexpected address " + url, proc, out)
    base, token = m.group(1), m.group(2)
    if request(base + "/state")[0] != 403 or request(base + "/state", token="x" * 32)[0] != 403:
        fail("a request without the token was served", proc, out)
    status, page = request(url)
    if status != 200 or "Pause now" not in page or "Resume" not in page:
        fail("the page did not load (status %d)" % status, proc, out)

    # The step advances, then the health monitor pauses the run (the demo's learning-rate blow-up).
    steps, state, t0 = set(), None, time.time()
    while time.time() - t0 < 300:
        status, body = request(base + "/state", token=token)
        if status != 200:
            fail("/state answered %d" % status, proc, out)
        state = json.loads(body)
        if state["step"] is not None:
            steps.add(state["step"])
        if state["paused"]:
            break
        if proc.poll() is not None:
            fail("the demo ended before it paused", None, out)
        time.sleep(0.1)
    else:
        fail("no pause within 300 s", proc, out)
    if len(steps) < 5:
        fail("the page saw the step advance only %d times before the pause" % len(steps), proc, out)
    if state["pause"] is None or state["pause"]["source"] != "torchdbg.health" or not state["pause"]["layer"]:
        fail("the pause does not name the monitor and a layer: %s" % state["pause"], proc, out)
    diagnosis = state["diagnosis"]
    if diagnosis is None or not diagnosis["summary"].startswith("Most likely cause"):
        fail("no diagnosis on the paused page: %s" % diagnosis, proc, out)
    status, sections = request(base + "/sections", token=token)
    if status != 200 or 'id="causal-graph"' not in sections:
        fail("the paused page's sections have no causal graph", proc, out)
    # The demo waits for Resume on the page; GET does not resume it.
    time.sleep(0.5)
    if request(base + "/resume", token=token)[0] != 405 or not json.loads(request(base + "/state", token=token)[1])["paused"]:
        fail("GET /resume was not refused, or the run went on without Resume", proc, out)
    status, body = request(base + "/resume", method="POST", token=token)
    if status != 200 or json.loads(body)["paused"]:
        fail("Resume failed (status %d)" % status, proc, out)
    try:
        rc = proc.wait(300)
    except subprocess.TimeoutExpired:
        fail("the demo did not finish after Resume", proc, out)
    text = "".join(out)
    if rc != 0 or "waiting for Resume on the live page" not in text or "finished 400 steps" not in text:
        fail("the demo ended with %d" % rc, None, out)
    print("drive_demo: paused at step %s on '%s', resumed from the page, finished: %s"
          % (state["pause"]["step"], state["pause"]["layer"], diagnosis["summary"][:90]))


main()
