"""A fork server for the SIGKILL stress test: imports torch and ember once, then
forks a fresh child per command, so that ten kill-and-resume rounds do not pay
ten interpreter start-ups. The parent process never runs a tensor operation
(forking after OpenMP threads exist would be unsafe).

Commands on stdin, one per line; answers on stdout:
    run ROOT RESUME(0|1) OUT|-  EPOCHS EVERY  ->  "pid <pid>"  (the child prints
                                                   "start ..." and "done" itself)
    wait PID                                   ->  "exit <pid> <code>"  (-9: SIGKILL)
    poll PID                                   ->  "exit <pid> <code>", or "alive <pid>"
    quit
"""
from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  (imported by the first optimizer; warm it here)

import resume_train  # noqa: E402


def child(root, resume, out, epochs, every) -> int:
    try:
        resume_train.run(root, resume=resume, out=None if out == "-" else out, epochs=epochs, every=every)
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    except BaseException:
        traceback.print_exc()
        return 1


def main():
    exited: dict[int, int] = {}
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "run":
            root, resume, out, epochs, every = cmd[1], cmd[2] == "1", cmd[3], int(cmd[4]), int(cmd[5])
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = child(root, resume, out, epochs, every)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            print(f"pid {pid}", flush=True)
        elif cmd[0] in ("wait", "poll"):
            pid = int(cmd[1])
            if pid not in exited:        # else reaped by an earlier poll
                done, status = os.waitpid(pid, os.WNOHANG if cmd[0] == "poll" else 0)
                if done:
                    exited[pid] = os.waitstatus_to_exitcode(status)
            print(f"exit {pid} {exited[pid]}" if pid in exited else f"alive {pid}", flush=True)
        elif cmd[0] == "quit":
            break


if __name__ == "__main__":
    main()
