"""`quietsync train`: the main job — a small GPT-Neo trained with any strategy on an embedded corpus.

Modules, one job each: ``loop`` (one worker's training loop), ``config`` / ``args`` (the job's flags),
``run_job`` (one parsed job), ``job_data`` (the job's ``--dataset`` prepared once and mapped: the bridge to the
data room), ``schedule`` (warm-up + cosine), ``slow_worker`` (simulated stragglers), ``checkpoint``, ``metrics`` /
``plots`` / ``sinks`` / ``trace`` (outputs). The loop reads batches from :mod:`quietsync.data` (corpus, tokenizer,
``quietsync prepare``, token shards, sharded sequences), which knows nothing of training. The ``quietsync``
command and ``quietsync compare`` are :mod:`quietsync.commands`; the models :mod:`quietsync.models`; the flag kit
and the launcher :mod:`quietsync.cli`, shared with ``quietsync plan``.
Needs the ``train`` extra: ``pip install 'quietsync[train]'``.
"""
