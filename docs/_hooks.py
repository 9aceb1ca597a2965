"""mkdocs hook: publishes the figures of experiments/results/ under results/.

The measured tables are included with pymdownx.snippets; the figures are files, so
they are added to the site here, and pages link them as `results/<name>.png`.
"""

import os

from mkdocs.structure.files import File

_RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "experiments", "results"
)


def on_files(files, config):
    for name in sorted(os.listdir(_RESULTS)):
        if name.endswith(".png"):
            files.append(
                File.generated(
                    config,
                    f"results/{name}",
                    abs_src_path=os.path.join(_RESULTS, name),
                )
            )
    return files
