"""`quietsync train`: the main job — a small GPT-Neo trained with any strategy on an embedded corpus.

Modules, one job each: ``corpus`` (text and its held-out split), ``tokenizer`` (local byte-level BPE, cached),
``data`` (sharded token sequences), ``model`` (GPT-Neo presets, parameter groups), ``schedule`` (warm-up +
cosine), ``slow_worker`` (simulated stragglers), ``metrics`` / ``plots`` (outputs), ``checkpoint``,
``loop`` (one worker's training loop), ``launch`` (local workers or torchrun), ``config`` / ``config_flags``
/ ``cli`` (the command line). Needs the ``train`` extra: ``pip install 'quietsync[train]'``.
"""
