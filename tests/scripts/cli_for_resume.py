"""Runs `cnftrace train` with a pause after each logged step, so that a test can kill
it mid-run with SIGKILL however fast the machine is (the pause changes no numbers).

    python cli_for_resume.py SECONDS_PER_STEP TRAIN_ARGS...
"""

import sys
import time

import cnftrace.cli._train as train
from cnftrace.cli import main as cli_main


def main():
    pause = float(sys.argv[1])
    fit = train.fit

    def slow_fit(*args, on_log, **kwargs):
        def logged(record):
            on_log(record)
            time.sleep(pause)

        return fit(*args, on_log=logged, **kwargs)

    train.fit = slow_fit
    return cli_main(["train", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
