"""The kit both command-line applications (``quietsync train``/``compare`` and ``quietsync plan``) are built
from: flags generated from config dataclasses with one-line errors (:mod:`~quietsync.cli.flags`), strategy specs
(:mod:`~quietsync.cli.spec`), starting the workers (:mod:`~quietsync.cli.launch`) and figures
(:mod:`~quietsync.cli.figures`)."""
