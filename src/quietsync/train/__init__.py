"""`quietsync train`: the main job — a small GPT-Neo trained with any strategy on an embedded corpus.

Modules, one job each: ``corpus`` (text and its held-out split), ``tokenizer`` (local byte-level BPE, cached),
``data`` (sharded token sequences), ``schedule`` (warm-up + cosine), ``slow_worker`` (simulated stragglers),
``metrics`` / ``plots`` (outputs), ``checkpoint``, ``loop`` (one worker's training loop), ``config`` / ``args``
(the job's flags), ``run_job`` (one parsed job). The ``quietsync`` command and ``quietsync compare`` are
:mod:`quietsync.commands`; the models :mod:`quietsync.models`; the flag kit and the launcher :mod:`quietsync.cli`,
shared with ``quietsync plan``. Needs the ``train`` extra: ``pip install 'quietsync[train]'``.
"""
