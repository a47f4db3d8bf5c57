"""The top floor: the ``quietsync`` command (:mod:`~quietsync.commands.main`, dispatching to ``train``,
``compare`` and ``plan``) and ``quietsync compare`` (:mod:`~quietsync.commands.compare`), which runs the trainer
several times and, with ``--predict``, the planner beside it."""
