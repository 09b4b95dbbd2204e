"""``python -m fv_core.parallel.worker``: one worker rank; its arguments arrive pickled on stdin."""

import pickle
import sys

from fv_core.parallel.group import worker_main

if __name__ == "__main__":
    worker_main(*pickle.loads(sys.stdin.buffer.read()))
