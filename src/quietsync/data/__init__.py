"""The data pipeline: text in, token windows out — it knows nothing of training.

Modules, one job each, in the order data flows: ``corpus`` (documents — the embedded KJV, a local file or
folder, a Hub dataset — and their held-out split), ``sources`` (any ``--dataset`` read as a stream of
documents), ``tokenizer`` (a local byte-level BPE or a pretrained one, built once under ``cache``'s lock),
``prepare`` (documents → token ids in shard files plus an ``index.json``: ``quietsync prepare``), written by
``shard_writer`` (resumably) or indexed in place by ``token_files`` (pre-tokenized ``.bin``/``.npy``), read back
memory-mapped by ``shards``, and ``sequences`` (a worker's disjoint, resumable share of fixed-length windows and
the fixed evaluation batches). The trainer reads batches from here (:mod:`quietsync.train.job_data` is its
bridge); nothing here imports the trainer. Heavy dependencies (``tokenizers``, ``datasets``, ``pyarrow``) load
inside the functions that use them; this face imports nothing.
"""
