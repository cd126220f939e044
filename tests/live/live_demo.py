# torchdbg — module hooks and a training debugger for LibTorch.
# SPDX-License-Identifier: MIT
"""Starts the demo with its live page (`training_loop WORK_DIR --live`) for the drivers beside
this file: the process, its output lines as they come, and the page's address."""
import re
import subprocess
import threading


def start(exe, work, timeout=120):
    """Returns (process, output lines, address); the address is None when none came within
    `timeout` seconds."""
    proc = subprocess.Popen([exe, work, "--live"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, url, ready = [], [None], threading.Event()

    def reader():
        for line in proc.stdout:
            out.append(line)
            m = re.search(r"live page: (http://\S+)", line)
            if m and url[0] is None:
                url[0] = m.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=reader, daemon=True).start()
    ready.wait(timeout)
    return proc, out, url[0]
