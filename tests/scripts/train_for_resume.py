"""Trains a tiny flow with checkpoints; used by test_checkpoint.py as a real process
that is killed with SIGKILL and resumed.

    python train_for_resume.py RUN_DIR LOG_FILE [STEPS] [SECONDS_PER_STEP] [REF_DIR]

SECONDS_PER_STEP (default 0) adds a pause after each logged step, so that a test can
kill the process mid-run however fast the machine is; it does not change the losses.
With REF_DIR, the process first trains the same run without pauses (checkpoints in
REF_DIR/checkpoints, the log in REF_DIR/log.jsonl, the losses in REF_DIR/losses.json),
then the run in RUN_DIR: the reference to compare with costs no process of its own
(each pays a few seconds of imports), and the second run compiles nothing.
"""

import json
import os
import sys
import time

import jax.random as jr
import optax

import cnftrace

# One optimiser object for both runs of a process: `fit` keeps the step's programs
# for a second run with the same one.
OPTIMIZER = optax.adam(1e-2)


def data(key, n):
    return 0.5 * jr.normal(key, (n, 2)) + 1.0


def train(run_dir, log_file, steps, pause):
    """The run's losses, step by step."""
    field = cnftrace.ConcatSquashMLP(2, width=8, depth=1, key=jr.key(0))
    flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-4, atol=1e-4)

    with open(log_file, "a") as log:

        def on_log(record):
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(pause)

        _, history = cnftrace.fit(
            flow,
            data,
            key=jr.key(1),
            steps=steps,
            batch_size=64,
            optimizer=OPTIMIZER,
            progress=False,
            checkpoints=cnftrace.Checkpoints(
                run_dir, every=5, keep=2, config={"lr": 1e-2, "model": "tiny"}
            ),
            on_log=on_log,
        )
    return history["loss"]


def main():
    run_dir, log_file = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    if len(sys.argv) > 5:
        ref_dir = sys.argv[5]
        os.makedirs(ref_dir, exist_ok=True)
        checkpoints = os.path.join(ref_dir, "checkpoints")
        losses = train(checkpoints, os.path.join(ref_dir, "log.jsonl"), steps, 0.0)
        with open(os.path.join(ref_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
    print(json.dumps(train(run_dir, log_file, steps, pause)))


if __name__ == "__main__":
    main()
