"""Where the tests find the repository, its experiments and the tests' scripts,
wherever a test file sits under tests/."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
EXPERIMENTS = os.path.join(ROOT, "experiments")
SCRIPTS = os.path.join(TESTS, "scripts")
